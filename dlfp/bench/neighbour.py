"""A noisy neighbour: a CPU-bound child process the bench starts and stops mid-run.

It spins one interpreter on a core (no I/O, no memory traffic to speak of), the
way another busy program on a laptop competes with the runtime. The bench
records when it ran, so each phase's figures can be separated.
"""
from __future__ import annotations

import subprocess
import sys
import time

SPIN = "while True:\n    pass\n"


class Neighbour:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.proc: subprocess.Popen | None = None
        self.started_s: float | None = None
        self.stopped_s: float | None = None

    def start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
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
