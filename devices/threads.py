"""Thread governor: run the steps on fewer threads while other programs hold cores.

    governor = ThreadGovernor(OtherLoad().read, max_threads=backend.max_threads)
    engine.thread_governor = governor        # callable(now) -> threads for the next step

A CPU runtime splits every op of a step across its threads and waits for the
slowest at each op (llama.cpp's threadpool barrier). When another program keeps
one of the cores busy, one thread per op is descheduled for a time slice and the
step waits for it: on 2 cores with one busy neighbour a decode that takes 10 ms
alone took most of a second. A prompt cap cannot fix that (the decode alone is
over any target); running on the cores nobody else wants does.

The governor is asked between steps and reads other programs' load (cores' worth
of CPU time used by other processes and stolen by the hypervisor: devices/cpu.py
`OtherLoad`, the figure the CPU probe records as `other_cores`) from `source`. The
engine's assembly gives it a `LoadWatch`, which measures that figure over the last
`READ_S` up to the moment it is asked (snapshots on its own thread keep the start of
that period even after a step of seconds), so the step after one a new neighbour
slowed already runs on fewer threads; `poll_s` spaces the governor's own reads (0
there: two small /proc reads a step). It wants
`max_threads - ceil(other_cores - slack)` threads, at least one: a neighbour using
less than `slack` of a core costs no thread. It lowers the count as soon as one
reading (itself an average over the probe period) asks for it, or once the wish
has held for `lower_after_s`: a step on too many threads beside a neighbour costs
the foreground a second, one on too few only background speed for a while. It
raises the count one thread at a time once the wish has held for `raise_after_s`,
so a short burst of someone else's work does not make it flap.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

log = logging.getLogger("dlfp.threads")

READ_S = 0.2  # the period other programs' load is measured over; a shorter one reacts to every brief burst of other work


class ThreadGovernor:
    def __init__(
        self,
        source: Callable[[], float | None],
        max_threads: int,
        min_threads: int = 1,
        slack: float = 0.4,
        lower_after_s: float = 0.0,
        raise_after_s: float = 2.0,
        poll_s: float = 0.2,
    ):
        if not 1 <= min_threads <= max_threads:
            raise ValueError(f"need 1 <= min_threads <= max_threads, got {min_threads}, {max_threads}")
        if slack < 0 or lower_after_s < 0 or raise_after_s < 0 or poll_s < 0:
            raise ValueError("slack, lower_after_s, raise_after_s and poll_s must be >= 0")
        self.source = source
        self.max_threads = max_threads
        self.min_threads = min_threads
        self.slack = slack
        self.lower_after_s = lower_after_s
        self.raise_after_s = raise_after_s
        self.poll_s = poll_s
        self.threads = max_threads
        self.others: float | None = None  # the latest reading of other programs' load (cores)
        self.transitions: list[tuple[float, int, float | None]] = []  # (time, threads, others)
        self._wish: int = max_threads
        self._wish_since: float | None = None
        self._last_poll: float | None = None

    def __call__(self, now: float) -> int:
        if self._last_poll is None or now - self._last_poll >= self.poll_s:
            self._last_poll = now
            others = self.source()
            if others is not None:  # None: no new figure yet (too soon) or none to be had
                self.others = others
                self._consider(self.wanted(others), now)
        return self.threads

    def wanted(self, others: float) -> int:
        """Threads to use beside `others` cores of other programs' load."""
        taken = max(0, math.ceil(others - self.slack))
        return max(self.min_threads, min(self.max_threads, self.max_threads - taken))

    def _consider(self, wish: int, now: float) -> None:
        if wish != self._wish:
            self._wish, self._wish_since = wish, now
        if wish == self.threads or self._wish_since is None:
            return
        held = now - self._wish_since
        if wish < self.threads and held >= self.lower_after_s:
            self._switch(wish, now)
        elif wish > self.threads and held >= self.raise_after_s:
            self._switch(self.threads + 1, now)  # one at a time: the next raise waits again
            self._wish_since = now

    def _switch(self, threads: int, now: float) -> None:
        log.info("step threads %d -> %d at %.3f s (other programs: %.2f cores)",
                 self.threads, threads, now, self.others or 0.0)
        self.threads = threads
        self.transitions.append((now, threads, self.others))

    def label(self) -> str:
        return f"{self.threads}/{self.max_threads}"

