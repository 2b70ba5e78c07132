"""How the kernel's CPU pressure averages over cores: the measurement behind scaling the
contention watch's threshold with the step's threads (dlfp/contention.py).

The system-wide "some" reading is each CPU's share of time with a task waiting for it,
averaged over the CPUs weighted by how long each was busy, so that idle CPUs do not dilute
it. One contended core among N busy ones should then read about 1 / N, and the same core
with the others idle about 1. Spinning processes pinned with `taskset` set each case up;
each reading is the counter's growth over `SECONDS` divided by the wall time.

    .venv/bin/python scripts/psi_weighting.py runs/<yyyy-mm-dd>-psi-weighting
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dlfp.bench.neighbour import SPIN  # a busy loop that ends with the process that started it
from dlfp.devices.pressure import cpu_stall_reader
from dlfp.provenance import write_config

SECONDS = float(os.environ.get("PSI_WEIGHTING_SECONDS", "3"))  # per case


def _spinners(cpus: list[int]) -> list[subprocess.Popen]:
    return [subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", SPIN, str(os.getpid())])
            for cpu in cpus]


def _reading(stalled, cpus: list[int]) -> float:
    procs = _spinners(cpus)
    try:
        time.sleep(0.5)  # every spinner scheduled
        t0, s0 = time.perf_counter(), stalled()
        time.sleep(SECONDS)
        return (stalled() - s0) / (time.perf_counter() - t0)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main(out: Path) -> None:
    stalled = cpu_stall_reader()
    if stalled is None:
        sys.exit("no /proc/pressure/cpu on this kernel")
    n = os.cpu_count() or 1
    if n < 2:
        sys.exit("needs two CPUs or more")
    cases = {  # name: the CPU of each spinner
        "one spinner on each CPU (no core contended)": list(range(n)),
        "two spinners on CPU 0, the others idle": [0, 0],
        "two spinners on CPU 0, one on each other CPU": [0, 0] + list(range(1, n)),
    }
    rows = [{"case": name, "spinners": cpus, "some_share": round(_reading(stalled, cpus), 3),
             "expected": [0.0, 1.0, round(1 / n, 3)][i]} for i, (name, cpus) in enumerate(cases.items())]
    out.mkdir(parents=True, exist_ok=True)
    (out / "psi_weighting.json").write_text(json.dumps({"cpus": n, "seconds": SECONDS, "rows": rows}, indent=1) + "\n")
    write_config(out)
    for r in rows:
        print(f"{r['case']}: some {r['some_share']:.3f} (about {r['expected']})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
