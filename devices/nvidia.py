"""NVIDIA GPUs through NVML (the `nvidia` extra: nvidia-ml-py, imported as pynvml).

Per GPU: name, temperature, power draw, the total energy counter (mJ since the
driver loaded; Volta and newer), SM clock, and the active clock event
("throttle") reasons. `throttling` is True when a thermal or hardware slowdown
reason is active; the software power cap alone is reported but is normal under
full load, so it does not count. NVML talks to the running driver, so this probe
reads only with the real root; without the module or the driver it says why.
Only the GPUs this process may use are read (CUDA_VISIBLE_DEVICES), so an idle GPU
outside the run never adds its energy to the run's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from dlfp.devices.reading import Reading, RootedProbe, live_only, unavailable

# (name, pynvml constant, counts as throttling)
CLOCK_EVENTS = (
    ("gpu_idle", "nvmlClocksThrottleReasonGpuIdle", False),
    ("applications_clocks", "nvmlClocksThrottleReasonApplicationsClocksSetting", False),
    ("sw_power_cap", "nvmlClocksThrottleReasonSwPowerCap", False),
    ("hw_slowdown", "nvmlClocksThrottleReasonHwSlowdown", True),
    ("sync_boost", "nvmlClocksThrottleReasonSyncBoost", False),
    ("sw_thermal_slowdown", "nvmlClocksThrottleReasonSwThermalSlowdown", True),
    ("hw_thermal_slowdown", "nvmlClocksThrottleReasonHwThermalSlowdown", True),
    ("hw_power_brake", "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", True),
)


class NvmlProbe(RootedProbe):
    name = "nvml"

    def __init__(self, root: str | Path = "/"):
        super().__init__(root)
        self._nvml = None
        self._why_not: str | None = None
        if not self.live:
            self._why_not = live_only(root, "NVML")
            return
        try:
            import pynvml
        except ImportError:
            self._why_not = "nvidia-ml-py is not installed (pip install 'dlfp[nvidia]')"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._why_not = f"NVML could not start: {exc} (no NVIDIA driver on this machine?)"
            return
        self._nvml = pynvml

    def read(self) -> list[Reading]:
        if self._nvml is None:
            return [unavailable(self.name, "nvml", self._why_not or "NVML is shut down")]
        n = self._nvml
        indices = visible_indices(n)
        if not indices:
            return [unavailable(self.name, "nvml", "NVML sees no GPU this process may use (CUDA_VISIBLE_DEVICES)")]
        return [self._gpu(i) for i in indices]

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None

    def _gpu(self, index: int) -> Reading:
        n = self._nvml
        h = n.nvmlDeviceGetHandleByIndex(index)
        values: dict = {}
        missing: dict[str, str] = {}
        fields = {
            "name": lambda: _text(n.nvmlDeviceGetName(h)),
            "temp_c": lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
            "power_w": lambda: n.nvmlDeviceGetPowerUsage(h) / 1e3,
            "energy_mj": lambda: int(n.nvmlDeviceGetTotalEnergyConsumption(h)),
            "sm_clock_mhz": lambda: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            "clock_event_mask": lambda: int(_clock_events(n, h)),
        }
        for key, get in fields.items():
            try:
                values[key] = get()
            except n.NVMLError as exc:
                missing[key] = f"NVML: {exc}"
        mask = values.get("clock_event_mask")
        if mask is not None:
            active = [(name, throttles) for name, const, throttles in CLOCK_EVENTS if mask & getattr(n, const, 0)]
            values["clock_events"] = [name for name, _ in active]
            values["throttling"] = any(throttles for _, throttles in active)
        return Reading(self.name, f"nvml:{index}", values, missing=missing)


def visible_indices(n, environ: Mapping[str, str] | None = None) -> list[int]:
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES lets this process use (all when unset).

    Entries are UUIDs (matched through NVML, prefixes allowed) or integers, taken as NVML
    indices (true under CUDA_DEVICE_ORDER=PCI_BUS_ID, and on machines of one GPU model).
    As CUDA does, the list ends at the first entry that names no device.
    """
    env = os.environ if environ is None else environ
    count = n.nvmlDeviceGetCount()
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    uuids = None
    out: list[int] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit() and int(entry) < count:
            out.append(int(entry))
            continue
        if uuids is None:
            uuids = [_text(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
        match = [i for i, u in enumerate(uuids) if entry and u.startswith(entry)]
        if not match:
            break
        out.append(match[0])
    return out


def _clock_events(n, handle) -> int:
    get = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
    return get(handle)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
