"""The engine loop for backends whose step dlfp owns.

One thread runs: admit -> plan (under the policy's cap) -> backend.step ->
observe -> sample -> deliver tokens. Callers on any thread `submit()` requests
and read tokens from the returned handle. The loop stamps every token with the
time its step completed, so ITL in the trace is what a client sees.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from dlfp.backends.protocol import Backend, BackendError
from dlfp.controller import CADENCE, DLFP, DLFPParams, PrefillPolicy, shape_of
from dlfp.sampling import sample
from dlfp.scheduler import PlannedStep, Scheduler
from dlfp.sequence import FOREGROUND, Request, Sequence, Status
from dlfp.trace import RequestRecord, StepRecord, Trace

log = logging.getLogger("dlfp.engine")


class InvalidRequest(ValueError):
    """The request was refused before it reached the scheduler (recorded in the trace)."""


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None  # None on the final event
    t: float
    finish_reason: str | None = None  # set on the final event
    error: str | None = None


class RequestHandle:
    """What `submit` returns: stream tokens, wait for the record, or cancel."""

    def __init__(
        self, engine: "Engine", request: Request, on_event: Callable[[TokenEvent], None] | None = None
    ):
        self.request = request
        self._engine = engine
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._on_event = on_event
        self._done = threading.Event()
        self.record: RequestRecord | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Every token event, ending with the final one (finish reason or error)."""
        while True:
            ev = self._events.get(timeout=timeout)
            yield ev
            if ev.finish_reason is not None:
                return

    def __iter__(self) -> Iterator[int]:
        for ev in self.events():
            if ev.token_id is not None:
                yield ev.token_id

    def result(self, timeout: float | None = None) -> RequestRecord:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.request_id} did not finish in {timeout} s")
        assert self.record is not None
        return self.record

    def cancel(self) -> None:
        self._engine.abort(self.request_id)

    def _deliver(self, ev: TokenEvent) -> None:
        self._events.put(ev)
        if self._on_event is not None:
            self._on_event(ev)  # runs on the engine thread: must be quick and must not raise

    def _finish(self, record: RequestRecord) -> None:
        self.record = record
        self._done.set()


@dataclass
class EngineConfig:
    preemption_budget_s: float | None = 0.5  # None: no budget (llama.cpp server behaviour)
    preemption_initial: int = 32  # first isolated background chunk, before any observation
    protect: tuple[str, ...] = (FOREGROUND,)
    seed: int = 0
    idle_wait_s: float = 0.05

    @classmethod
    def for_policy(cls, policy: PrefillPolicy, profile) -> "EngineConfig":
        """Engine settings for `policy` on a device profile.

        Unbounded stands for llama.cpp's server: whole prompts up to the batch size
        and no preemption budget either; every other policy gets the profile's budget.
        """
        from dlfp.controller import Unbounded

        budget = None if isinstance(policy, Unbounded) else profile.preemption_budget_s
        return cls(preemption_budget_s=budget, preemption_initial=profile.preemption_initial)


class Engine:
    def __init__(
        self,
        backend: Backend,
        policy: PrefillPolicy,
        config: EngineConfig | None = None,
        trace: Trace | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.backend = backend
        self.policy = policy
        self.config = config or EngineConfig()
        self.clock = clock
        self.trace = trace or Trace(origin=clock())
        caps = backend.capabilities
        self.scheduler = Scheduler(caps, self.config.protect)
        self.preemption = self._make_preemption(caps.max_batch_tokens)
        self._handles: dict[str, RequestHandle] = {}
        self._seqs: dict[str, Sequence] = {}
        self._rngs: dict[str, np.random.Generator] = {}
        self._inbox: list[tuple[str, object]] = []
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._prev_call: float | None = None
        self._prev_capped = False
        self.step_hooks: list[Callable[[StepRecord], None]] = []
        # Thermal governor hook: gate(now) -> (background prefill may run, label for StepRecord.governor).
        self.background_gate: Callable[[float], tuple[bool, str | None]] | None = None

    def _make_preemption(self, n_batch: int) -> DLFP | None:
        budget = self.config.preemption_budget_s
        if budget is None:
            return None
        initial = max(1, min(self.config.preemption_initial, n_batch))
        # The same proportional law, aimed at the budget, sizes isolated background chunks.
        return DLFP(DLFPParams(budget, initial, 1, n_batch, 1))

    # -- caller side -------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dlfp-engine", daemon=True)
            self._thread.start()
        return self

    def submit(
        self, request: Request, on_event: Callable[[TokenEvent], None] | None = None
    ) -> RequestHandle:
        """Queue a request; raises InvalidRequest (and records it) if it cannot run.

        `on_event`, if given, also receives every event as it is delivered (on the
        engine thread), so an event loop can be woken without a thread per request.
        """
        now = self.clock()
        handle = RequestHandle(self, request, on_event)
        caps = self.backend.capabilities
        try:
            request.validate(caps.vocab_size, caps.context_per_sequence)
            with self._wake:  # the checks and the queueing are one step against a stopping loop
                if self._stop:
                    raise ValueError("the engine has stopped")
                if request.request_id in self._handles:
                    raise ValueError(f"duplicate request id {request.request_id!r}")
                self._handles[request.request_id] = handle
                self._inbox.append(("submit", Sequence(request, arrival_s=now)))
                self._wake.notify()
        except ValueError as exc:
            record = self._record(Sequence(request, arrival_s=now), "error", str(exc), now)
            handle._deliver(TokenEvent(request.request_id, None, now, "error", str(exc)))
            handle._finish(record)
            raise InvalidRequest(str(exc)) from None
        return handle

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    def shutdown(self, abort_pending: bool = True, timeout: float = 30.0) -> list[str]:
        """Stop the loop. Returns the ids of requests that were aborted."""
        aborted: list[str] = []
        if abort_pending:
            with self._wake:
                pending = [rid for rid, h in self._handles.items() if h.record is None]
                self._inbox.extend(("abort", rid) for rid in pending)
                aborted = pending
        else:
            self.wait_idle(timeout)
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        return aborted

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(h.record is None for h in list(self._handles.values())):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def load(self) -> dict:
        """Queue depth and running sequences per class (for /metrics and admission)."""
        s = self.scheduler
        return {
            "waiting_foreground": len(s.waiting[FOREGROUND]),
            "waiting_background": len(s.waiting["background"]),
            "running": len(s.running),
            "cap": self.policy.cap(),
        }

    # -- engine thread -----------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a broken runtime: no request may be left hanging
            log.exception("engine loop crashed")
            self._fail_everything(f"engine stopped: {type(exc).__name__}: {exc}")

    def _fail_everything(self, message: str) -> None:
        with self._wake:
            self._stop = True
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "submit":
                self._seqs[item.request.request_id] = item
        for seq in list(self._seqs.values()):
            self._finish(seq, "error", message, self.clock(), free_slot=False)  # the runtime is gone

    def _loop(self) -> None:
        while True:
            with self._wake:
                if not self._inbox and not self.scheduler.has_work() and not self._stop:
                    self._wake.wait(self.config.idle_wait_s)
                inbox, self._inbox = self._inbox, []
                stop = self._stop
            self._take(inbox)
            if stop:
                return
            if self.scheduler.has_work():
                self._step()

    def _take(self, inbox: list[tuple[str, object]]) -> None:
        for kind, item in inbox:
            if kind == "submit":
                seq = item
                self._seqs[seq.request.request_id] = seq
                self._rngs[seq.request.request_id] = np.random.default_rng(_seed_for(seq.request, self.config.seed))
                self.scheduler.add(seq)
            elif kind == "abort" and item in self._seqs:
                self._finish(self._seqs[item], "abort", None, self.clock())

    def _step(self) -> None:
        for seq in self.scheduler.admit():
            self.backend.free_sequence(seq.slot)  # slot reuse starts from an empty cache
        t_call = self.clock()
        guarded = self.scheduler.guarded()
        observed = self._observe_cadence(t_call)
        if not guarded:
            self.policy.reset()
        cap = self.policy.cap() if guarded else None
        bg_allowed, gate_label = self.background_gate(t_call) if self.background_gate else (True, None)
        bg_cap = self.preemption.cap() if self.preemption is not None else None
        if not bg_allowed:
            bg_cap = 0
        step = self.scheduler.plan(cap, bg_cap, background=bg_allowed)
        if step.plan.is_empty():
            self._prev_call = None
            time.sleep(self.config.idle_wait_s)  # background held back by the governor
            return
        try:
            result = self.backend.step(step.plan)
        except BackendError as exc:
            self._fail_plan(step, str(exc))
            return
        if step.guarded and self.policy.source != CADENCE:  # decode-only guarded steps too: the base cost
            observed = result.duration_s
            self.policy.observe(observed, cap=step.cap, shape=shape_of(step.plan))
        if step.budgeted and self.preemption is not None:
            self.preemption.observe(result.duration_s)
        self._prev_call, self._prev_capped = t_call, step.capped
        t_done = self.clock()
        self._apply(step, result.logits, t_done)
        self._record_step(step, result, t_call, t_done, observed, gate_label)

    def _observe_cadence(self, t_call: float) -> float | None:
        """The paper's proxy: interval between scheduler calls after a capped step."""
        if self.policy.source != CADENCE or not self._prev_capped or self._prev_call is None:
            return None
        interval = t_call - self._prev_call
        self.policy.observe(interval)
        return interval

    def _apply(self, step: PlannedStep, logits: dict, t_done: float) -> None:
        by_slot = {s.slot: s for s in self.scheduler.running}
        for chunk in step.plan.prefills:
            seq = by_slot[chunk.seq_id]
            seq.n_prefilled = chunk.end
            seq.n_prefill_chunks += 1
        sampled = [by_slot[d.seq_id] for d in step.plan.decodes]
        sampled += [by_slot[c.seq_id] for c in step.plan.prefills if c.wants_logits]
        for seq in sampled:
            if seq.status == Status.FINISHED:
                continue
            try:
                row = logits[seq.slot]
                token = sample(row, seq.request.sampling, self._rngs[seq.request.request_id])
            except (KeyError, ValueError) as exc:
                self._finish(seq, "error", f"sampling failed: {exc}", t_done)
                continue
            seq.status = Status.DECODING
            seq.output_ids.append(token)
            seq.token_times.append(t_done)
            self._handles[seq.request.request_id]._deliver(TokenEvent(seq.request.request_id, token, t_done))
            reason = self._stop_reason(seq, token)
            if reason:
                self._finish(seq, reason, None, t_done)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if not seq.request.ignore_eos and self.backend.is_eos(token):
            return "stop"
        if len(seq.output_ids) >= seq.request.max_tokens:
            return "length"
        if seq.next_position + 1 >= self.backend.capabilities.context_per_sequence:
            return "length"  # the context is full: no room for the next token
        return None

    def _fail_plan(self, step: PlannedStep, message: str) -> None:
        slots = {d.seq_id for d in step.plan.decodes} | {c.seq_id for c in step.plan.prefills}
        now = self.clock()
        log.error("step failed (%s); failing %d sequence(s)", message, len(slots))
        for seq in [s for s in self.scheduler.running if s.slot in slots]:
            self._finish(seq, "error", message, now)

    def _finish(self, seq: Sequence, reason: str, error: str | None, now: float, free_slot: bool = True) -> None:
        if seq.status == Status.FINISHED:
            return
        had_slot = seq in self.scheduler.running
        self.scheduler.release(seq)
        if had_slot and free_slot:
            self.backend.free_sequence(seq.slot)
        seq.status = Status.FINISHED
        rid = seq.request.request_id
        record = self._record(seq, reason, error, now)
        handle = self._handles[rid]
        handle._deliver(TokenEvent(rid, None, now, reason, error))
        handle._finish(record)
        self._seqs.pop(rid, None)
        self._rngs.pop(rid, None)

    def _record(self, seq: Sequence, reason: str, error: str | None, now: float) -> RequestRecord:
        seq.finish_reason, seq.error, seq.finished_s = reason, error, now
        record = RequestRecord(
            request_id=seq.request.request_id,
            priority=seq.priority,
            tag=seq.request.tag,
            arrival_s=seq.arrival_s,
            prompt_len=seq.prompt_len,
            output_ids=list(seq.output_ids),
            token_times=list(seq.token_times),
            finish_reason=reason,
            error=error,
            finished_s=now,
            n_prefill_chunks=seq.n_prefill_chunks,
        )
        self.trace.add_request(record)
        return record

    def _record_step(
        self, step: PlannedStep, result, t0: float, t1: float, observed: float | None, governor: str | None = None
    ) -> None:
        unreachable = self.policy.target_unreachable
        if unreachable:
            self.trace.note(_unreachable_note(self.policy))
        rec = StepRecord(
            t0=t0,
            t1=t1,
            duration_s=result.duration_s,
            n_decode=step.plan.n_decode,
            n_prefill_fg=step.n_prefill_fg,
            n_prefill_bg=step.n_prefill_bg,
            guarded=step.guarded,
            cap=step.cap,
            bg_cap=step.bg_cap,
            observed_s=observed,
            unreachable=unreachable,
            device_duration_s=result.device_duration_s,
            governor=governor,
        )
        self.trace.add_step(rec)
        for hook in self.step_hooks:
            hook(rec)


def _seed_for(request: Request, base: int) -> int:
    if request.sampling.seed is not None:
        return request.sampling.seed
    return (base * 1_000_003 + zlib.crc32(request.request_id.encode())) & 0xFFFFFFFF


def _unreachable_note(policy: PrefillPolicy) -> str:
    target = policy.describe().get("target_ms")
    return (
        f"ITL target {target:.0f} ms is unreachable on this device: even the minimum "
        f"prefill cap misses it (the decode step alone may be slower); the cap stays at its minimum"
    )
