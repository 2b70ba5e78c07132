"""The GPU a vLLM run uses: exclusivity check, identity, clocks and energy through NVML.

The paper refused to measure while unrelated processes held the GPU; so does this.
`nvml` is the pynvml module (or a stand-in with the same calls, in tests).
"""
from __future__ import annotations

from dataclasses import dataclass


class GpuBusy(RuntimeError):
    """Unrelated processes are using a GPU this run would measure."""


@dataclass(frozen=True)
class GpuProcess:
    gpu: int
    pid: int
    used_mib: float | None


def gpu_processes(nvml) -> list[GpuProcess]:
    """Compute and graphics processes on every GPU NVML sees."""
    found: dict[tuple[int, int], GpuProcess] = {}
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            for p in getattr(nvml, getter)(handle):
                used = getattr(p, "usedGpuMemory", None)
                found[(i, p.pid)] = GpuProcess(i, p.pid, used / 2**20 if isinstance(used, int) else None)
    return list(found.values())


def check_exclusive(nvml, own_pids: set[int]) -> None:
    """Raise GpuBusy naming the unrelated processes, if any."""
    foreign = [p for p in gpu_processes(nvml) if p.pid not in own_pids]
    if foreign:
        listed = ", ".join(
            f"pid {p.pid} on GPU {p.gpu}" + (f" ({p.used_mib:.0f} MiB)" if p.used_mib is not None else "")
            for p in foreign
        )
        raise GpuBusy(f"unrelated processes are using the GPU: {listed}; stop them before measuring")


def describe_gpus(nvml) -> dict:
    """Driver, and per GPU: name, clocks (current and maximum), power limit."""
    def get(fn, *args):
        try:
            value = getattr(nvml, fn)(*args)
        except Exception as exc:  # noqa: BLE001 - NVML reports unsupported queries as errors
            return f"unavailable: {exc}"
        return value.decode() if isinstance(value, bytes) else value

    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        gpus.append({
            "index": i,
            "name": get("nvmlDeviceGetName", h),
            "sm_clock_mhz": get("nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM),
            "sm_clock_max_mhz": get("nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": get("nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_MEM),
            "power_limit_w": (lambda v: v / 1e3 if isinstance(v, int) else v)(get("nvmlDeviceGetEnforcedPowerLimit", h)),
        })
    return {"driver": get("nvmlSystemGetDriverVersion"), "gpus": gpus}


def energy_mj(nvml) -> dict[int, int]:
    """Total energy counter (mJ since the driver loaded) per GPU that has one."""
    out = {}
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            out[i] = int(nvml.nvmlDeviceGetTotalEnergyConsumption(nvml.nvmlDeviceGetHandleByIndex(i)))
        except Exception:  # noqa: BLE001 - pre-Volta GPUs have no counter
            continue
    return out
