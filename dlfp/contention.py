"""Cut a step that another program has started to slow, as soon as it shows.

A step on several threads beside a program that has just taken a core runs 2-6x its
time: each op waits for the thread that was descheduled. The cut at the decision's
deadline (`cut_at` x T) bounds that step, but the deadline plus the decodes' rerun is
still one ITL of 1.4-2 T, and a reply's own P99 <= 1.1 T absorbs one ITL of about
1.25 T, no more. The watch reads how long some task has waited for a core (a cumulative
counter, `devices/pressure.py`) every `poll_s` while a guarded step runs, and cuts the
step once that waiting has covered `share` of the latest `window_s` (a program that
starts late in a step is seen as soon as one that was there from its start): the
decodes then rerun alone on one thread (`Engine._rerun_on_one_thread`). The kernel
averages the share over the cores. On this project's 2-core machine
(`scripts/psi_probe.py`, runs/2026-12-04-psi-probe), 20 ms windows during llama.cpp
steps on both cores read a median 1 %, 57 % at the 99th percentile, alone (bursts near
100 % in 3 steps of 30, about once a second, which the watch reads as contention too:
its cuts on a quiet machine, docs/benchmarks.md), and 37-101 %, median 51 %, from the
first window after a program spinning on one core started (steps of 160-219 ms then
took 323-1196 ms). A guarded step with no prompt token is watched too: no deadline bounds
it, and beside the neighbour three such steps on two threads took 230-335 ms in 16 trials
(runs/2026-12-04-contention35-nn, runs/2026-12-05-position-goodput-nn); cuts for contention
ended 24 ms into the step in the median, 91 at most. A step on one thread is not
watched: beside another program it is not slowed the same way, and a rerun would run on
the same thread. A cut pays while the decodes' rerun on one thread (the decision's
decode-only time times the threads: a bound, threads rarely scale perfectly) is predicted
to end within 1.1 T, the goal a reply's own P99 is judged against, and for the first half
of T at least (`StepObserver.watch_within_s`): then a cut on a burst of our own threads'
work, where the step would have ended near its prediction, still ends its ITL within the
goal, while a neighbour that shows only after the first half of T is cut before
the deadline. Beside the neighbour, it started 42-77 ms into a guarded step at
T = 100 ms in 13 trials of the benches of 2026-12-06 (`runs/2026-12-06-*-nn`), each cut at
its deadline and its decodes rerun in 23-56 ms: ITLs of 157-194 ms; over 100 starts
(scripts/neighbour_start_probe.py, runs/2026-12-06-neighbour-start) the chat's ITLs over
1.1 T at a start were 3 with this window, 11 with the first half only. Watched over the
whole step, one cut at 81 ms on our own threads' burst made a 129 ms ITL of what would
have been a ~95 ms one (a rerun of 48 ms: two decodes on one thread, which the bound
puts at 2 x 26 ms and does not cut after 58 ms).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable


class ContentionWatch:
    def __init__(self, stalled_s: Callable[[], float], cut: Callable[[], None], share: float = 0.35,
                 window_s: float = 0.02, poll_s: float = 0.005):
        if not 0 < share <= 1 or window_s <= 0 or poll_s <= 0:
            raise ValueError(f"need 0 < share <= 1, window_s > 0, poll_s > 0; got {share}, {window_s}, {poll_s}")
        self.stalled_s, self.cut = stalled_s, cut
        self.share, self.window_s, self.poll_s = share, window_s, poll_s
        self.fired = False  # the watch cut the step it last watched
        self._polls: deque[tuple[float, float]] | None = None  # (time, stalled) since the step started
        self._until = 0.0  # the step is not cut after this time
        self._wake = threading.Condition()
        self._closed = False

    def start(self) -> "ContentionWatch":  # an engine companion: started and stopped with it
        self._closed = False
        threading.Thread(target=self._run, name="dlfp-contention-watch", daemon=True).start()
        return self

    def arm(self, within_s: float) -> None:
        """The step that starts now is watched for its first `within_s`."""
        with self._wake:
            self.fired, now = False, time.perf_counter()
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
        """Some task waited for a core `share` of the latest window (one poll appended)."""
        now = (time.perf_counter(), self.stalled_s())
        polls.append(now)
        while len(polls) > 2 and now[0] - polls[1][0] >= self.window_s:
            polls.popleft()  # polls[0]: the latest poll at least a window old
        t0, s0 = polls[0]
        return now[0] - t0 >= self.window_s and now[1] - s0 >= self.share * (now[0] - t0)
