"""One trial: a target under one policy, fed one seed's schedule open-loop.

Warmup requests run first, one at a time, so caches and threads are warm. Then a
submitter thread sleeps until each scheduled arrival and submits; it never waits
for completions (open loop). The caller's thread collects the handles as they
finish (for the progress bar) and finally closes the target for its trace.

Multi-turn sessions arrive open-loop too; within one, a thread submits each turn a
think time after the previous reply, its prompt built then from that turn's prompt
and reply (they exist only at run time). A turn that fails ends its session: the
turns left are recorded as refused, with the reason.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from dlfp.bench.target import RunTarget
from dlfp.sequence import Request
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
    cache_prompt: bool = True,
) -> TrialRun:
    """`cache_prompt=False`: every request asks for a cold prefill (llama.cpp's field)."""
    refused: dict[str, str] = {}
    t_start = time.perf_counter()
    arm.target.open(arm.policy)  # an engine target samples probes itself (dlfp.assembly)
    try:
        for p in schedule.warmup:  # closed loop: one after another
            _wait(_submit(arm.target, p, refused, cache_prompt=cache_prompt))
            if on_done:
                on_done()
        lag, neighbour = _open_loop(arm.target, schedule, refused, on_done, cache_prompt)
    finally:
        trace = arm.target.close()
    window = None
    if neighbour is not None and neighbour.started_s is not None:
        window = (neighbour.started_s, neighbour.stopped_s)
        trace.note(f"neighbour: a CPU-bound process (pid {neighbour.proc.pid}) ran from "
                   f"{neighbour.started_s - trace.origin:.3f} s to {neighbour.stopped_s - trace.origin:.3f} s")
    return TrialRun(schedule.seed, arm.name, order, trace, refused, lag, time.perf_counter() - t_start, window)


def _open_loop(target: RunTarget, schedule: Schedule, refused: dict, on_done, cache_prompt: bool):
    """Submit on schedule (single requests from one thread, each session from its own);
    returns (largest submission lag, the Neighbour if one ran)."""
    from dlfp.bench.neighbour import Neighbour

    handles: queue.Queue = queue.Queue()
    lag = [0.0]
    window = schedule.neighbour_s
    neighbour = Neighbour() if window is not None else None
    # (time from the start, action), run by the submitter between submissions
    events = sorted([(window[0], neighbour.start), (window[1], neighbour.stop)]) if neighbour else []
    t0 = time.perf_counter()

    def wait_until(arrival_s: float) -> None:
        delay = t0 + arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        lag[0] = max(lag[0], -delay)

    def submitter() -> None:
        pending = list(events)
        try:
            for p in schedule.singles():
                pending = _fire(pending, t0, p.arrival_s)
                wait_until(p.arrival_s)
                handles.put(_submit(target, p, refused, cache_prompt=cache_prompt))
            _fire(pending, t0, float("inf"))
        finally:
            handles.put(_END)

    def session(turns: tuple[PlannedRequest, ...]) -> None:
        try:
            wait_until(turns[0].arrival_s)
            _run_session(target, turns, refused, handles.put, cache_prompt)
        finally:
            handles.put(_END)

    threads = [threading.Thread(target=submitter, name="dlfp-bench-submit", daemon=True)]
    threads += [threading.Thread(target=session, args=(turns,), name=f"dlfp-bench-{turns[0].session}", daemon=True)
                for turns in schedule.sessions()]
    for thread in threads:
        thread.start()
    try:
        ended = 0
        while ended < len(threads):
            handle = handles.get()
            if handle is _END:
                ended += 1
                continue
            _wait(handle)
            if on_done:
                on_done()
        for thread in threads:
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


def _run_session(target: RunTarget, turns: tuple[PlannedRequest, ...], refused: dict, put, cache_prompt: bool) -> None:
    """One chat: each turn's prompt = the previous prompt + its reply + this turn's message."""
    history: list[int] = []
    for k, p in enumerate(turns):
        if k:
            time.sleep(p.think_s)
        request = p.to_request(history, cache_prompt)
        handle = _submit(target, p, refused, request)
        put(handle)
        why = _turn_failed(handle, p)
        if why is not None:
            for later in turns[k + 1 :]:
                refused[later.request_id] = f"session ended: {p.request_id} {why}"
            return
        history = request.prompt_ids + handle.result().output_ids


def _turn_failed(handle, p: PlannedRequest) -> str | None:
    """Why a session cannot go on after this turn (None: it can)."""
    if handle is None:
        return "was refused"
    try:
        record = handle.result()
    except Exception as exc:  # noqa: BLE001 - the trace records the failure
        return f"failed ({type(exc).__name__}: {exc})"
    if not record.ok or len(record.output_ids) != p.max_tokens:
        return f"failed ({record.error or 'short output'})"
    if min(record.output_ids, default=0) < 0:
        return "got a reply without token ids (the server does not return them): the next prompt cannot be built"
    return None


def _submit(target: RunTarget, p: PlannedRequest, refused: dict, request: Request | None = None,
            cache_prompt: bool = True):
    """Submit now; a refusal (or a transport error) is recorded, never raised."""
    try:
        return target.submit(request if request is not None else p.to_request(cache_prompt=cache_prompt))
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
