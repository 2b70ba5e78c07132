"""A noisy neighbour: a CPU-bound child process the bench starts and stops mid-run.

It spins one interpreter on a core (no I/O, no memory traffic to speak of), the
way another busy program on a laptop competes with the runtime. The bench
records when it ran, so each phase's figures can be separated.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

# It spins until its parent is gone: a bench killed by a signal runs no `stop()`, and a
# spinner it left behind would slow every later run on the machine (checked every ~100k
# iterations, a few ms: the core stays busy). The parent's pid comes as an argument: a
# parent that dies while the child's interpreter starts must not be missed.
SPIN = ("import os, sys\n"
        "while os.getppid() == int(sys.argv[1]):\n"
        "    for _ in range(100_000):\n"
        "        pass\n")


class Neighbour:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.proc: subprocess.Popen | None = None
        self.started_s: float | None = None
        self.stopped_s: float | None = None

    def start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.started_s = self.clock()

    def stop(self) -> None:
        if self.proc is not None and self.stopped_s is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.stopped_s = self.clock()

    def describe(self) -> dict:
        return {"pid": self.proc.pid if self.proc else None, "started_s": self.started_s,
                "stopped_s": self.stopped_s}
