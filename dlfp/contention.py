"""Cut a step that another program has started to slow, as soon as it shows.

A step on several threads beside a program that has just taken a core runs 2-6x its time:
each op waits at its barrier for the thread that was descheduled. The deadline cut
(`cut_at` x T) bounds such a step, but the deadline plus the decodes' rerun is one ITL of
1.4-2 T, where a reply's own P99 <= 1.1 T absorbs one ITL of about 1.25 T. The watch reads
how long some task has waited for a core (a cumulative counter, `devices/pressure.py`)
every `poll_s` while a guarded step runs, and cuts the step once that waiting has covered
`core_share` of one core's time over the latest `window_s` (a program that starts late in a
step shows as soon as one that was there from its start); the decodes then rerun alone on
one thread fewer (`Engine._rerun_on_fewer_threads`). Guarded steps with no prompt token are
watched too (no deadline bounds them); steps on one thread are not (a rerun would run on the
same thread).
The engine arms the watch for `StepObserver.watch_within_s`: while the rerun is predicted to
end within 1.1 T, and for the first half of T at least, so that a false alarm (a burst of
the engine's own threads, about once a second on two cores) still ends its ITL within the
goal. The kernel averages its reading over the CPUs, each weighted by how long it was busy
(idle ones do not dilute it), so one contended core among a step's N threads reads 1 / N of
the time its task waits (`scripts/psi_weighting.py`: 0.507 with two cores busy, 0.995 with the
other idle): the watch compares the reading with `core_share` / N, the step's threads. Where
other programs keep more cores busy without contending, the reading is diluted further and
a cut comes later or not at all. docs/controller.md ("Cutting a step as soon as another
program slows it") gives the measurements behind `core_share`, `window_s` and how long a
step is watched.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable


class ContentionWatch:
    def __init__(self, stalled_s: Callable[[], float], cut: Callable[[], None], *, core_share: float,
                 window_s: float, poll_s: float = 0.005):
        # core_share and window_s: the device profile's (contention_core_share, contention_window_ms),
        # their one home.
        if not 0 < core_share <= 1 or window_s <= 0 or poll_s <= 0:
            raise ValueError(f"need 0 < core_share <= 1, window_s > 0, poll_s > 0; got {core_share}, {window_s}, {poll_s}")
        self.stalled_s, self.cut = stalled_s, cut
        self.core_share, self.window_s, self.poll_s = core_share, window_s, poll_s
        self.share = core_share  # of the kernel's reading, for the step last armed: core_share / its threads
        self.fired = False  # the watch cut the step it last watched
        self._polls: deque[tuple[float, float]] | None = None  # (time, stalled) since the step started
        self._until = 0.0  # the step is not cut after this time
        self._wake = threading.Condition()
        self._closed = False

    def start(self) -> "ContentionWatch":  # an engine companion: started and stopped with it
        self._closed = False
        threading.Thread(target=self._run, name="dlfp-contention-watch", daemon=True).start()
        return self

    def arm(self, within_s: float, threads: int) -> None:
        """The step that starts now, on `threads` threads, is watched for its first `within_s`."""
        with self._wake:
            self.fired, now = False, time.perf_counter()
            self.share = self.core_share / max(threads, 1)
            self._polls, self._until = deque([(now, self.stalled_s())]), now + within_s
            self._wake.notify()

    def disarm(self) -> None:
        with self._wake:
            self._polls = None

    def stop(self) -> None:
        with self._wake:
            self._closed, self._polls = True, None
            self._wake.notify()

    def _run(self) -> None:
        with self._wake:
            while not self._closed:
                if self._polls is None:
                    self._wake.wait()
                    continue
                self._wake.wait(self.poll_s)
                if self._polls is not None and time.perf_counter() > self._until:
                    self._polls = None  # too late to be worth a cut
                elif self._polls is not None and self._contended(self._polls):
                    self.fired, self._polls = True, None
                    self.cut()

    def _contended(self, polls: deque[tuple[float, float]]) -> bool:
        """Some task waited for a core `share` of the latest window, as the kernel averages it
        over the busy cores (one poll appended)."""
        now = (time.perf_counter(), self.stalled_s())
        polls.append(now)
        while len(polls) > 2 and now[0] - polls[1][0] >= self.window_s:
            polls.popleft()  # polls[0]: the latest poll at least a window old
        t0, s0 = polls[0]
        return now[0] - t0 >= self.window_s and now[1] - s0 >= self.share * (now[0] - t0)
