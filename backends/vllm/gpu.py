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


def used_gpus(nvml, own_pids: set[int], expected: int, environ: dict | None = None) -> tuple[list[int], str]:
    """NVML indices of the GPUs this run uses, and how they were found.

    1. where our own processes (vLLM's workers) hold a context: exact, once the engine runs;
    2. else the first `expected` GPUs CUDA_VISIBLE_DEVICES allows (all GPUs when unset).
    Idle GPUs outside the run are never summed into its energy.
    """
    from dlfp.devices.nvidia import visible_indices

    mine = sorted({p.gpu for p in gpu_processes(nvml) if p.pid in own_pids})
    if mine:
        return mine, "GPUs holding this run's processes (NVML)"
    return visible_indices(nvml, environ)[:expected], f"the first {expected} GPU(s) CUDA_VISIBLE_DEVICES allows"


def energy_samples(nvml, gpus: list[int], t: float) -> list[dict]:
    """One trace sample per GPU in the form the energy report reads (`energy_mj`, cumulative)."""
    counters = energy_mj(nvml)
    return [{"t": t, "probe": "nvml", "source": f"nvml:{g}", "energy_mj": counters[g]} for g in gpus if g in counters]


def cuda_driver_version(nvml) -> tuple[int, int] | None:
    """The newest CUDA the installed driver supports, e.g. (12, 8); None if NVML cannot tell."""
    try:
        v = int(nvml.nvmlSystemGetCudaDriverVersion())
    except Exception:  # noqa: BLE001 - old NVML
        return None
    return v // 1000, (v % 1000) // 10


def check_cuda_driver(nvml, torch_cuda: str | None) -> str | None:
    """Raise if the driver cannot run the CUDA major version torch was built for.

    Returns a warning line when only the minor version is newer than the driver's (CUDA's
    minor-version compatibility usually runs it, but PTX JIT and some kernels may fail).
    `torch_cuda` is `torch.version.cuda` (None: a CPU build of torch).
    """
    if not torch_cuda:
        raise RuntimeError("the installed torch is a CPU build: install a CUDA build of torch for this GPU")
    driver = cuda_driver_version(nvml)
    if driver is None:
        return "could not read the driver's CUDA version from NVML; not checked"
    need = tuple(int(x) for x in torch_cuda.split(".")[:2])
    if need[0] > driver[0]:
        raise RuntimeError(f"torch is built for CUDA {torch_cuda} but the driver supports CUDA "
                           f"{driver[0]}.{driver[1]} at most: update the NVIDIA driver or install a torch built for "
                           f"CUDA {driver[0]}.x")
    if need > driver:
        return (f"torch is built for CUDA {torch_cuda}, the driver supports {driver[0]}.{driver[1]}: "
                f"minor-version compatibility applies (PTX JIT is unavailable); update the driver if kernels fail")
    return None
