"""One trial: a target under one policy, fed one seed's schedule open-loop.

Warmup requests run first, one at a time, so caches and threads are warm. Then a
submitter thread sleeps until each scheduled arrival and submits; it never waits
for completions (open loop). The caller's thread collects the handles as they
finish (for the progress bar) and finally closes the target for its trace.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from dlfp.bench.target import RunTarget
from dlfp.trace import Trace
from dlfp.workloads.schedule import PlannedRequest, Schedule

log = logging.getLogger("dlfp.bench")

_END = object()


@dataclass
class Arm:
    """A column of the comparison: a policy on a target, or an endpoint under its label."""

    name: str
    target: RunTarget
    policy: str


@dataclass
class TrialRun:
    seed: int
    arm: str
    order: int  # position of this arm in the seed's run order
    trace: Trace
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why submit raised
    max_submit_lag_s: float = 0.0  # how far behind schedule the latest submission was
    wall_s: float = 0.0
    neighbour: tuple[float, float] | None = None  # when the busy neighbour ran (engine clock)


def run_trial(
    arm: Arm,
    schedule: Schedule,
    order: int = 0,
    on_done: Callable[[], None] | None = None,
) -> TrialRun:
    refused: dict[str, str] = {}
    t_start = time.perf_counter()
    arm.target.open(arm.policy)  # an engine target samples probes itself (dlfp.assembly)
    try:
        for p in schedule.warmup:  # closed loop: one after another
            _wait(_submit(arm.target, p, refused))
            if on_done:
                on_done()
        lag, neighbour = _open_loop(arm.target, schedule.measured, refused, on_done, schedule.neighbour_s)
    finally:
        trace = arm.target.close()
    window = None
    if neighbour is not None and neighbour.started_s is not None:
        window = (neighbour.started_s, neighbour.stopped_s)
        trace.note(f"neighbour: a CPU-bound process (pid {neighbour.proc.pid}) ran from "
                   f"{neighbour.started_s - trace.origin:.3f} s to {neighbour.stopped_s - trace.origin:.3f} s")
    return TrialRun(schedule.seed, arm.name, order, trace, refused, lag, time.perf_counter() - t_start, window)


def _open_loop(target: RunTarget, planned: tuple[PlannedRequest, ...], refused: dict, on_done,
               neighbour_s: tuple[float, float] | None = None):
    """Returns (largest submission lag, the Neighbour if one ran)."""
    from dlfp.bench.neighbour import Neighbour

    handles: queue.Queue = queue.Queue()
    lag = [0.0]
    neighbour = Neighbour() if neighbour_s is not None else None
    # (time from the start, action), run by the submitter between submissions
    events = sorted([(neighbour_s[0], neighbour.start), (neighbour_s[1], neighbour.stop)]) if neighbour else []

    def submitter() -> None:
        t0 = time.perf_counter()
        pending = list(events)
        try:
            for p in planned:
                pending = _fire(pending, t0, p.arrival_s)
                delay = t0 + p.arrival_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                lag[0] = max(lag[0], -delay)
                handles.put(_submit(target, p, refused))
            _fire(pending, t0, float("inf"))
        finally:
            handles.put(_END)

    thread = threading.Thread(target=submitter, name="dlfp-bench-submit", daemon=True)
    thread.start()
    try:
        while (handle := handles.get()) is not _END:
            _wait(handle)
            if on_done:
                on_done()
        thread.join()
    finally:
        if neighbour is not None:
            neighbour.stop()  # never leave the child running
    return lag[0], neighbour


def _fire(events: list, t0: float, until_s: float) -> list:
    """Run the events due before `until_s` (seconds from t0), each at its time; returns the rest."""
    while events and events[0][0] <= until_s:
        at, action = events.pop(0)
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        action()
    return events


def _submit(target: RunTarget, p: PlannedRequest, refused: dict):
    """Submit now; a refusal (or a transport error) is recorded, never raised."""
    try:
        return target.submit(p.to_request())
    except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
        refused[p.request_id] = f"{type(exc).__name__}: {exc}"
        log.warning("request %s refused: %s", p.request_id, exc)
        return None


def _wait(handle) -> None:
    """Wait for a request to finish; its outcome is read from the trace afterwards."""
    if handle is None:
        return
    try:
        handle.result()
    except Exception as exc:  # noqa: BLE001 - the trace records the failure
        log.warning("request %s: %s", handle.request_id, exc)
