"""What the kernel's CPU pressure reads around another program's start, during llama.cpp
steps on two threads (the measurement behind dlfp/contention.py's threshold).

Runs 60 identical 40-token steps of the default model on two threads, starts a program
spinning on one core before step 30, and writes per step its time and the share of each
20 ms window (polled every 5 ms) in which some task waited for a core.

    .venv/bin/python scripts/psi_probe.py runs/<yyyy-mm-dd>-psi-probe
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from dlfp.devices.pressure import cpu_stall_reader
from dlfp.models import default_model_path
from dlfp.protocol import Limits, PrefillChunk, StepPlan
from dlfp.provenance import write_config

POLL_S, WINDOW_POLLS, STEPS, NEIGHBOUR_AT = 0.005, 4, 60, 30


def main(out: Path) -> None:
    stalled = cpu_stall_reader()
    if stalled is None:
        sys.exit("no /proc/pressure/cpu on this kernel")
    model = default_model_path()
    backend = LlamaCppBackend(LlamaCppConfig(str(model), limits=Limits(2, 1024, 64), n_threads=2))
    polls, done = [], threading.Event()

    def poll() -> None:
        while not done.is_set():
            polls.append((time.perf_counter(), stalled()))
            time.sleep(POLL_S)

    threading.Thread(target=poll, daemon=True).start()
    plan = StepPlan(prefills=[PrefillChunk(0, list(range(100, 140)), 0, True)])
    steps, neighbour, t_on = [], None, None
    try:
        for i in range(STEPS):
            if i == NEIGHBOUR_AT:
                neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                t_on = time.perf_counter()
            backend.free_sequence(0)
            t0 = time.perf_counter()
            backend.step(plan)
            steps.append((t0, time.perf_counter()))
    finally:
        done.set()
        if neighbour is not None:
            neighbour.kill()
        backend.close()
    rows = []
    for t0, t1 in steps:
        ps = [p for p in polls if t0 <= p[0] <= t1]
        shares = [round((ps[k][1] - ps[k - WINDOW_POLLS][1]) / (ps[k][0] - ps[k - WINDOW_POLLS][0]), 3)
                  for k in range(WINDOW_POLLS, len(ps))]
        rows.append({"t0_s": t0 - steps[0][0], "ms": (t1 - t0) * 1e3, "after_neighbour": t_on is not None and t0 >= t_on,
                     "window_shares": shares})
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_config(out, {"neighbour_started_s": t_on - steps[0][0]}, models=[model], threads=2)
    for label, after in (("alone", False), ("beside the neighbour", True)):
        sel = [r for r in rows if r["after_neighbour"] == after]
        shares = sorted(s for r in sel for s in r["window_shares"])
        ms = sorted(r["ms"] for r in sel)
        print(f"{label}: steps {ms[0]:.0f}-{ms[-1]:.0f} ms; 20 ms windows waiting {shares[0]:.2f}-{shares[-1]:.2f} "
              f"(median {shares[len(shares) // 2]:.2f})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/psi-probe"))
