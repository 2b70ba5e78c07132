"""Pick a device profile from what the probes see.

Order: Android markers -> phone; an NVIDIA GPU (NVML name) -> h200 or a100-paper;
otherwise a CPU machine -> cpu-laptop (battery or not: the profile is about the
CPU runtime, and the reason says which). A flag overrides the choice.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dlfp.devices.probes import ProbeSet
from dlfp.devices.profile_files import profile_text
from dlfp.devices.reading import Reading, is_live

# GPU name patterns -> profile (first match wins)
GPU_PROFILES = (
    (re.compile(r"\b(GH200|H200|H100|H800|H20|B200|B100|GB200)\b", re.I), "h200"),
    (re.compile(r"\b(A100|A800)\b", re.I), "a100-paper"),
)
ANDROID_MARKERS = (("system", "build.prop"), ("system", "bin", "app_process64"), ("system", "bin", "app_process"))


@dataclass(frozen=True)
class Detection:
    profile: str
    reason: str
    overridden: bool = False


def detect_profile(root: str | Path = "/", readings: list[Reading] | None = None,
                   override: str | None = None) -> Detection:
    """The profile for this machine (or the tree under root); raises ValueError for a bad override."""
    if override:
        profile_text(override)  # one clear error for an unknown name
        return Detection(override, "chosen by flag", overridden=True)
    if readings is None:
        with ProbeSet(root) as probes:
            readings = probes.read()
    android = _android_marker(root)
    if android:
        return Detection("phone", f"Android marker {android}")
    gpus = [r.values["name"] for r in readings if r.probe == "nvml" and r.ok and "name" in r.values]
    if gpus:
        for pattern, profile in GPU_PROFILES:
            if pattern.search(gpus[0]):
                return Detection(profile, f"NVIDIA GPU {gpus[0]!r}")
        why = f"NVIDIA GPU {gpus[0]!r} has no profile of its own; the A100 point is the nearest"
        return Detection("a100-paper", why)
    has_battery = any(r.probe == "battery" and r.ok for r in readings)
    what = "a battery: a laptop" if has_battery else "no battery: a desktop, server or VM"
    return Detection("cpu-laptop", f"no NVIDIA GPU, {what}; a CPU runtime")


def _android_marker(root: str | Path) -> str | None:
    for parts in ANDROID_MARKERS:
        path = Path(root, *parts)
        if path.exists():
            return str(path)
    if is_live(root) and "ANDROID_ROOT" in os.environ:
        return "$ANDROID_ROOT"
    return None
