"""What every probe returns: a value, or "unavailable" with the reason.

A probe never raises into a run: `safe_read` turns any failure into an
unavailable reading. Sysfs paths are resolved under a root directory (default
"/"), so tests can build a tree of real files and the real probe code reads it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

log = logging.getLogger("dlfp.devices")


@dataclass
class Reading:
    probe: str  # family: cpu, thermal, hwmon, rapl, battery, nvml
    source: str  # the sensor within the family: "thermal_zone0", "intel-rapl:0", "nvml:0"
    values: dict = field(default_factory=dict)
    unavailable: str | None = None  # why nothing could be read from this source
    missing: dict[str, str] = field(default_factory=dict)  # field -> why this one field is absent

    @property
    def ok(self) -> bool:
        return self.unavailable is None

    def as_sample(self, t: float) -> dict:
        """The flat dict that goes into `Trace.add_sample`."""
        sample = {"t": t, "probe": self.probe, "source": self.source, **self.values}
        if self.unavailable is not None:
            sample["unavailable"] = self.unavailable
        if self.missing:
            sample["missing"] = dict(self.missing)
        return sample

    def describe(self) -> str:
        if self.unavailable is not None:
            return f"unavailable: {self.unavailable}"
        parts = [f"{k}={_fmt(v)}" for k, v in self.values.items()]
        parts += [f"{k}: unavailable ({why})" for k, why in self.missing.items()]
        return ", ".join(parts)


def unavailable(probe: str, source: str, reason: str) -> Reading:
    return Reading(probe, source, unavailable=reason)


class Probe(Protocol):
    name: str

    def read(self) -> list[Reading]: ...


class RootedProbe:
    """Base of the probes: sysfs under `root`; `live` when root is the running system."""

    name = ""

    def __init__(self, root: str | Path = "/"):
        self.root = root
        self.live = is_live(root)


def safe_read(probe: Probe) -> list[Reading]:
    """Read a probe; any exception becomes an unavailable reading."""
    try:
        readings = probe.read()
    except Exception as exc:  # a probe must never take a run down
        log.debug("probe %s failed", probe.name, exc_info=True)
        return [unavailable(probe.name, probe.name, f"probe failed: {type(exc).__name__}: {exc}")]
    return readings or [unavailable(probe.name, probe.name, "the probe returned nothing")]


def is_live(root: str | Path) -> bool:
    """True when root is the running system's "/" (psutil and NVML read only that)."""
    return Path(root).resolve() == Path("/")


def live_only(root: str | Path, what: str) -> str:
    return f"{what} reads the running system only; skipped for root={root}"


def sys_path(root: str | Path, *parts: str) -> Path:
    return Path(root, *parts)


def read_text(path: Path) -> str:
    return path.read_text().strip()


def read_number(path: Path) -> int:
    return int(read_text(path))


def read_field(path: Path, parse: Callable[[Path], object], out: dict, missing: dict, key: str) -> None:
    """Read one sysfs file into out[key], or record why not in missing[key]."""
    try:
        out[key] = parse(path)
    except FileNotFoundError:
        missing[key] = f"{path} does not exist"
    except PermissionError:
        missing[key] = f"{path} is readable by root only"
    except (OSError, ValueError) as exc:
        missing[key] = f"{path}: {exc}"


def _fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)
