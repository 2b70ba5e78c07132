"""All probes behind one object.

    probes = ProbeSet(root="/")     # or a folder holding a fake sys/ tree
    for r in probes.read():         # list[Reading]; never raises
        print(r.probe, r.source, r.describe())
    probes.close()

Families: cpu (dlfp.devices.cpu), thermal and hwmon (dlfp.devices.thermal),
rapl (dlfp.devices.rapl), battery (dlfp.devices.battery), nvml (dlfp.devices.nvidia).
"""
from __future__ import annotations

from pathlib import Path

from dlfp.devices.battery import BatteryProbe
from dlfp.devices.cpu import CpuProbe
from dlfp.devices.nvidia import NvmlProbe
from dlfp.devices.rapl import RaplProbe
from dlfp.devices.reading import Probe, Reading, safe_read, unavailable
from dlfp.devices.thermal import HwmonProbe, ThermalZoneProbe

FAMILIES = {
    "cpu": CpuProbe,
    "thermal": ThermalZoneProbe,
    "hwmon": HwmonProbe,
    "rapl": RaplProbe,
    "battery": BatteryProbe,
    "nvml": NvmlProbe,
}


class ProbeSet:
    def __init__(self, root: str | Path = "/", families: tuple[str, ...] | None = None):
        self.root = root
        self.probes: list[Probe] = []
        self.broken: list[Reading] = []  # probes whose constructor failed
        for name in families or tuple(FAMILIES):
            if name not in FAMILIES:
                raise ValueError(f"unknown probe family {name!r}; known: {', '.join(FAMILIES)}")
            try:
                self.probes.append(FAMILIES[name](root))
            except Exception as exc:  # a probe must never take a run down
                self.broken.append(unavailable(name, name, f"probe failed to start: {type(exc).__name__}: {exc}"))

    def read(self) -> list[Reading]:
        out = list(self.broken)
        for probe in self.probes:
            out.extend(safe_read(probe))
        return out

    def close(self) -> None:
        for probe in self.probes:
            close = getattr(probe, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> "ProbeSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
