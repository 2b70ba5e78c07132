"""Provenance of a kept result: what ran, from which code, on which machine, with which model.

Every folder under `runs/` carries a `config.json` built here, so a figure in the
docs can be traced to the exact command, the commit (and whether the tree had
uncommitted changes), the host and the model file's sha256. One writer serves the
bench, the laptop job, the batch benchmark and the GPU script.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

DISTRIBUTIONS = ("dlfp", "numpy", "scipy", "llama-cpp-python", "vllm", "torch", "openai", "executorch", "apache-tvm")
REPO = Path(__file__).resolve().parent.parent


def command_line() -> str:
    """The command as typed: `dlfp ...` for the console script, else the interpreter's argv."""
    if not sys.argv:
        return "dlfp"
    prog = Path(sys.argv[0]).name
    head = ["dlfp"] if prog in ("dlfp", "__main__.py") else [prog]
    return " ".join([*head, *sys.argv[1:]])


def git_state(repo: Path = REPO) -> dict:
    """The commit id and whether tracked files differ from it; None where no git checkout is found."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "clean": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "clean": status == "" if status is not None else None}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def machine(threads: int | None = None) -> dict:
    try:
        import psutil

        physical, logical = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
        memory_gb = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # the GPU machine runs without the project's dependencies
        physical, logical, memory_gb = None, os.cpu_count(), None
    return {
        "platform": platform.platform(),
        "processor": _cpu_model() or platform.processor(),
        "physical_cores": physical,
        "logical_cores": logical,
        "memory_gb": memory_gb,
        "hostname": platform.node(),
        "threads_used": threads,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        # Runnable processes over the last 1, 5 and 15 minutes when the config was written:
        # on a shared machine, how busy it was says how far the figures are the machine's own.
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def model_hashes(paths) -> dict:
    """{path: {sha256, bytes}} for each model file that exists (folders and missing paths are skipped)."""
    from dlfp.models import file_sha256

    out = {}
    for path in paths:
        if path and Path(path).is_file() and str(path) not in out:
            out[str(path)] = {"sha256": file_sha256(Path(path)), "bytes": Path(path).stat().st_size}
    return out


def provenance(*, command: str | None = None, models=(), threads: int | None = None) -> dict:
    """The fields every kept run's config.json has."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command or command_line(),
        "git": git_state(),
        "models": model_hashes(models),
        "versions": versions(),
        "machine": machine(threads),
    }


def write_config(out: Path, extra: dict | None = None, **kwargs) -> Path:
    """Write `out/config.json`: provenance() plus the run's own fields (args, workload, ...)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = provenance(**kwargs)
    cfg.update(extra or {})
    path = out / "config.json"
    path.write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    return path
