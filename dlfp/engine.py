"""The engine loop for backends whose step dlfp owns.

One thread runs: admit -> plan (under the policy's cap) -> backend.step ->
observe -> sample -> update sequences -> deliver events. Callers on any thread
`submit()` requests and read tokens from the returned handle. Every token is
stamped with the time its step completed, so ITL in the trace is what a client sees.

The scheduler owns each sequence's life (admit, plan, update after a step, finish);
the step observer (`dlfp.observer`) decides what the policy is fed; the engine
runs the loop, samples, and delivers. Build one with `dlfp.assembly.build_engine`,
which decides the policy's budget, governor and probes in one place.

Pipelined mode (a backend with `pipelined = True`, like vLLM's async scheduling):
step k+1 is planned and launched before step k's tokens reach the host; its decodes
feed the tokens step k sampled on the device (PLACEHOLDER_TOKEN), so sampling is
greedy on the device. `dlfp` is fed the step's own completed time as the backend
measured it on the device's clock (its `duration_s`: CUDA events around the step),
never the host time at collection, which comes after the next step's launch;
`dlfp-cadence` the interval between plannings, which no longer measures the device
once steps overlap.

Isolation: whatever one request carries (its sampling parameters, its callback)
can fail that request only; a failing step fails the requests in it; the loop
itself ends only after repeated failures it cannot pin on any request, and then
says so in `failure`.
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

from dlfp.protocol import Backend, BackendError, DoneStep, PendingStep, StepPlan, StepResult
from dlfp.policy import PrefillPolicy
from dlfp.contention import ContentionWatch
from dlfp.controller import make_budget_policy
from dlfp.observer import StepObserver, step_shape
from dlfp.trace import ARRIVAL, CONTENTION, DEADLINE
from dlfp.prefix_cache import DEFAULT_HOLD_S
from dlfp.sampling import sample
from dlfp.scheduler import DEFAULT_TTFT_GOAL_S, PlannedStep, Scheduler
from dlfp.sequence import FOREGROUND, FinishReason, Request, Sequence, Status
from dlfp.trace import RequestRecord, StepRecord, Trace

log = logging.getLogger("dlfp.engine")

# Loop failures in a row that no request can be blamed for before the engine gives up.
MAX_LOOP_FAILURES = 3


class InvalidRequest(ValueError):
    """The request was refused before it reached the scheduler (recorded in the trace)."""


class EngineStopped(InvalidRequest):
    """The engine is not running (stopped, or its loop died: see `Engine.failure`)."""


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None  # None on the final event
    t: float
    finish_reason: str | None = None  # set on the final event
    error: str | None = None
    cached_tokens: int | None = None  # prompt tokens reused from a cached prefix (every event of a started request)


class RequestHandle:
    """What `submit` returns: stream tokens, wait for the record, or cancel.

    With `on_event`, events go to the callback only (nothing is queued), so a
    caller that never iterates the handle leaves nothing behind.
    """

    def __init__(
        self, engine: "Engine", request: Request, on_event: Callable[[TokenEvent], None] | None = None
    ):
        self.request = request
        self._engine = engine
        self._on_event = on_event
        self._events: queue.Queue[TokenEvent] | None = None if on_event else queue.Queue()
        self._done = threading.Event()
        self.record: RequestRecord | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Every token event, ending with the final one (finish reason or error)."""
        if self._events is None:
            raise RuntimeError("this handle delivers its events to on_event")
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
        """Runs on the engine thread. Raises what the caller's callback raised."""
        if self._on_event is not None:
            self._on_event(ev)
        else:
            self._events.put(ev)

    def _finish(self, record: RequestRecord) -> None:
        self.record = record
        self._done.set()


@dataclass
class EngineConfig:
    """How the engine runs. What a policy implies (its budget) is decided in dlfp.assembly."""

    preemption_budget_s: float | None = 0.5  # None: no budget (llama.cpp server behaviour)
    preemption_initial: int = 32  # first isolated background chunk, before any observation
    protect: tuple[str, ...] = (FOREGROUND,)
    seed: int = 0
    idle_wait_s: float = 0.05
    prefix_reuse: bool = True  # reuse cached prompt prefixes where the backend can (requests may opt out)
    prefix_hold_s: float | None = DEFAULT_HOLD_S  # a conversation's cached prefix is kept from background this long
    ttft_goal_s: float = DEFAULT_TTFT_GOAL_S  # a foreground request's TTFT goal where it names none (the profile's)


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
        self.trace.max_threads = backend.max_threads if backend.threads is not None else None
        caps = backend.capabilities
        self.scheduler = Scheduler(caps, self.config.protect, backend.is_eos, self.config.prefix_reuse,
                                   self.config.prefix_hold_s, self.config.ttft_goal_s)
        self.trace.slot_evictions = self.scheduler.cache.evictions  # counted where slots are chosen
        budget = None
        if self.config.preemption_budget_s is not None:
            budget = make_budget_policy(self.config.preemption_budget_s, self.config.preemption_initial,
                                        caps.max_batch_tokens)
        self.observer = StepObserver(policy, clock, self._on_step, budget)
        self._handles: dict[str, RequestHandle] = {}  # requests not yet finished
        self._seqs: dict[str, Sequence] = {}
        self._rngs: dict[str, np.random.Generator] = {}
        self._inbox: list[tuple[str, object]] = []
        self._wake = threading.Condition()
        self._background_running = False  # a background step a new turn may cut is on the device
        self._stop = False
        self._thread: threading.Thread | None = None
        self._step_no = 0
        self.pipelined = bool(getattr(backend, "pipelined", False))
        self._in_flight: tuple[int, PlannedStep, PendingStep] | None = None  # launched, not yet collected
        self.failure: str | None = None  # why the loop died (None while it has not)
        self.step_hooks: list[Callable[[StepRecord], None]] = []
        # Thermal governor hook: gate(now) -> (background prefill may run, label for StepRecord.governor).
        self.background_gate: Callable[[float], tuple[bool, str | None]] | None = None
        # Thread governor hook: threads(now) -> threads the next step should use (backend.set_threads).
        self.thread_governor: Callable[[float], int] | None = None
        # Cuts a guarded step on several threads that another program starts to slow (a companion too).
        self.contention_watch: ContentionWatch | None = None
        self.companions: list = []  # started and stopped with the engine (probe sampler)

    @property
    def preemption(self) -> PrefillPolicy | None:
        """The policy sizing isolated background chunks (None: no preemption budget)."""
        return self.observer.budget

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # -- caller side -------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            for c in self.companions:
                c.start()
            self._thread = threading.Thread(target=self._run, name="dlfp-engine", daemon=True)
            self._thread.start()
        return self

    def submit(
        self, request: Request, on_event: Callable[[TokenEvent], None] | None = None
    ) -> RequestHandle:
        """Queue a request; raises InvalidRequest (and records it) if it cannot run.

        `on_event`, if given, receives every event as it is delivered (on the engine
        thread, so it must be quick); an exception it raises fails its request only.
        """
        now = self.clock()
        handle = RequestHandle(self, request, on_event)
        caps = self.backend.capabilities
        try:
            request.validate(caps.vocab_size, caps.context_per_sequence)
            if self.pipelined and request.sampling.temperature != 0.0:
                raise ValueError(f"{self.backend.name} runs pipelined and samples greedily on the device: "
                                 f"temperature must be 0, got {request.sampling.temperature}")
            rng = np.random.default_rng(_seed_for(request, self.config.seed))
            with self._wake:  # the checks and the queueing are one step against a stopping loop
                if self._stop:
                    raise EngineStopped(self.failure or "the engine has stopped")
                if request.request_id in self._handles:
                    raise ValueError(f"duplicate request id {request.request_id!r}")
                self._handles[request.request_id] = handle
                self._inbox.append(("submit", (Sequence(request, arrival_s=now), rng)))
                self._wake.notify()
                if self._background_running and request.priority in self.config.protect:
                    self.backend.cut_step()  # a new turn does not wait for the documents' step
                    self._background_running = False
        except ValueError as exc:
            seq = Sequence(request, arrival_s=now)
            seq.finish_reason, seq.error, seq.finished_s = FinishReason.ERROR, str(exc), now
            record = self._record(seq)
            _safe_deliver(handle, TokenEvent(request.request_id, None, now, FinishReason.ERROR, str(exc)))
            handle._finish(record)
            kind = EngineStopped if isinstance(exc, EngineStopped) else InvalidRequest
            raise kind(str(exc)) from None
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
                aborted = list(self._handles)
                self._inbox.extend(("abort", rid) for rid in aborted)
        else:
            self.wait_idle(timeout)
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for c in self.companions:
            c.stop()
        return aborted

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._handles:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def load(self) -> dict:
        """Queue depth and running sequences per class (for /metrics and admission)."""
        s = self.scheduler
        return {
            "waiting_foreground": len(s.waiting[FOREGROUND]),
            "waiting_background": sum(len(q) for cls, q in s.waiting.items() if cls != FOREGROUND),
            "running": len(s.running),
            "cap": self._next_cap(),
        }

    def _next_cap(self) -> int | None:
        """The cap of the latest guarded decision (None: uncapped, or none yet), read without
        asking the policy (it counts its asks) from another thread."""
        decision = self.observer.decision
        return None if decision is None else decision.cap

    # -- engine thread -----------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a broken runtime: no request may be left hanging
            log.exception("engine loop crashed")
            self._fail_everything(f"engine stopped: {type(exc).__name__}: {exc}")

    def _fail_everything(self, message: str) -> None:
        with self._wake:
            self.failure = message
            self._stop = True
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "submit":
                seq, rng = item
                self._seqs[seq.request.request_id] = seq
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.ERROR, message, free_slot=False)  # the runtime is gone

    def step(self) -> bool:
        """One pass of the loop: take what was submitted or aborted, then plan, run, observe
        and deliver one step if there is work. Returns whether a step was planned.

        The engine thread calls it; `dlfp study` calls it directly (no thread started) on
        the simulated backend and a virtual clock, so both run the same admission,
        planning, observation and update."""
        self._take_inbox()
        if not self.scheduler.has_work() and self._in_flight is None:
            return False
        self._step()
        return True

    def _take_inbox(self) -> None:
        with self._wake:
            inbox, self._inbox = self._inbox, []
        self._take(inbox)

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._wake:
                idle = not self.scheduler.has_work() and self._in_flight is None
                if not self._inbox and idle and not self._stop:
                    self._wake.wait(self.config.idle_wait_s)
                stop = self._stop
            if stop:
                self._take_inbox()
                self._drain()
                return
            try:
                self.step()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - not pinned on a request: fail the running ones
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                if failures >= MAX_LOOP_FAILURES:
                    raise
                self._drain()
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.ERROR, f"engine step failed: {type(exc).__name__}: {exc}")

    def _take(self, inbox: list[tuple[str, object]]) -> None:
        for kind, item in inbox:
            if kind == "submit":
                seq, rng = item
                self._seqs[seq.request.request_id] = seq
                self._rngs[seq.request.request_id] = rng
                self.scheduler.add(seq)
            elif kind == "abort" and item in self._seqs:
                self._finish(self._seqs[item], FinishReason.ABORT)

    def _itl_target_s(self) -> float | None:
        """The target the next guarded step is planned against (None: the policy's own)."""
        policy = self.policy
        if policy.spent_factor == 1.0:
            return self.scheduler.itl_target_s()
        return self.scheduler.itl_target_s(policy.params.target_s, policy.spent_factor)

    def _step(self) -> None:
        for seq in self.scheduler.admit(self.clock()):
            self._prepare_slot(seq)
        obs = self.observer
        if self.thread_governor is not None:
            self._set_threads(self.thread_governor(self.clock()))
        sched = self.scheduler
        turn_first = self.policy.plans_turns and sched.turn_loading()
        cap = obs.begin(sched.guarded(), sched.planned_decodes(turn_first), self._itl_target_s(), turn_first,
                        sched.next_prompt_position(turn_first))
        bg_allowed, gate_label = self.background_gate(self.clock()) if self.background_gate else (True, None)
        step = sched.plan(cap, obs.budget_cap() if bg_allowed else 0, background=bg_allowed, turn_first=turn_first)
        self._schedule(step, gate_label)
        previous, self._in_flight = self._in_flight, None
        if step.plan.is_empty():
            if previous is not None:  # nothing more can be planned before it is back
                self._collect(*previous)
            else:
                time.sleep(self.config.idle_wait_s)  # background held back by the governor
            return
        try:
            if self.pipelined:
                pending = self.backend.launch(step.plan)
            else:
                step, pending = self._run_now(step, gate_label)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail; the engine goes on
            message = str(exc) if isinstance(exc, BackendError) else f"{type(exc).__name__}: {exc}"
            self._fail_plan(step, message)
            if previous is not None:
                self._collect(*previous)
            return
        self.scheduler.launched(step)
        if previous is not None:  # step k is collected only after step k+1 is queued
            self._collect(*previous)
        if self.pipelined:
            self._in_flight = (self._step_no, step, pending)
        else:
            self._collect(self._step_no, step, pending)

    def _schedule(self, step: PlannedStep, gate_label: str | None) -> None:
        self._step_no += 1
        self.observer.scheduled(self._step_no, step.guarded, step.cap, step_shape(step),
                                n_prefill_bg=step.n_prefill_bg, bg_cap=step.bg_cap, governor=gate_label,
                                threads=self.backend.threads, n_decode_held=step.n_decode_held)

    def _run_now(self, step: PlannedStep, gate_label: str | None) -> tuple[PlannedStep, PendingStep]:
        """Run a step synchronously. A guarded step with prompt tokens still running at its
        decision's deadline is cut (where the backend can): it is recorded, and its
        protected decodes run alone, so a slowdown that caught it mid-way (another program
        starting) costs the streams the deadline plus a decode, not the whole slowed step.
        On several threads the contention watch may cut it sooner, and a decode-only guarded
        step too (dlfp/contention.py); a background step alone is cut by a foreground arrival
        (`_run_preemptible`)."""
        obs = self.observer
        if self._preemptible(step):
            return self._run_preemptible(step)
        cuts = self.backend.capabilities.cut_steps
        limit = obs.cut_after_s(step.guarded, step.plan.n_prefill) if cuts else None
        # Decode-only guarded steps are watched too: nothing else bounds one that a program
        # starting mid-step slows (230-335 ms on two threads beside the neighbour).
        threads = self.backend.threads or 1
        within = (obs.watch_within_s(threads) if cuts and step.guarded and self.contention_watch is not None
                  and threads > 1 else None)
        if limit is None and within is None:
            return step, DoneStep(self.backend.step(step.plan))
        watch = self.contention_watch if within is not None else None
        if watch is not None:
            watch.arm(within, threads)
        try:
            result = self.backend.step_within(step.plan, limit)
        finally:
            if watch is not None:
                watch.disarm()
        if not result.cut:
            return step, DoneStep(result)
        obs.completed(self._step_no, result.duration_s, cut=CONTENTION if watch is not None and watch.fired else DEADLINE)
        if self.thread_governor is not None:  # a program that just started is what cuts most steps
            self._set_threads(self.thread_governor(self.clock()))
        step = self.scheduler.plan(obs.after_cut(), 0)  # cap 0: background decodes wait too
        return step, DoneStep(self._rerun_on_fewer_threads(step, gate_label))

    def _preemptible(self, step: PlannedStep) -> bool:
        """Background prompt tokens alone, under a preemption budget (which bounds what a new
        turn waits), on a backend that can cut a step: a foreground arrival cuts it."""
        return (self.backend.capabilities.cut_steps and step.bg_cap is not None and not step.guarded
                and step.n_prefill_bg > 0 and step.n_prefill_fg == 0)

    def _run_preemptible(self, step: PlannedStep) -> tuple[PlannedStep, PendingStep]:
        """A background step that a foreground request's arrival cuts (`submit`): the new turn
        then loads at once instead of a budget's step later, and the chunk, none of which ran,
        is planned again. (One arriving between this loop's intake and the flag waits for the
        step, as where the backend cannot cut.)"""
        with self._wake:
            self._background_running = True
        try:
            result = self.backend.step_within(step.plan, None)
        finally:
            with self._wake:
                self._background_running = False
        if not result.cut:
            return step, DoneStep(result)
        self.observer.completed(self._step_no, result.duration_s, cut=ARRIVAL)
        nothing = PlannedStep(StepPlan(), guarded=False, cap=None, bg_cap=None, n_prefill_fg=0, n_prefill_bg=0)
        return nothing, DoneStep(StepResult(logits={}, duration_s=0.0))

    def _rerun_on_fewer_threads(self, step: PlannedStep, gate_label: str | None) -> StepResult:
        """A cut step's decodes, alone on one thread fewer where the governor may switch
        threads. What runs a step past its deadline is most often a program that has just
        taken a core, before its load shows in the governor's reading: on every thread the
        decodes wait at each op for the thread it descheduled (beside a neighbour that had
        just started, such reruns took up to 305 ms on two threads; on one, 21-52 ms). One
        thread fewer leaves that core to the program; on N cores one thread alone would run
        the decodes up to N times as long (not measured beyond two cores: on two, one thread
        fewer is one). The rerun is not observed by the controller, so the thread count it
        runs on is not the device's: no `device_changed`."""
        before = self.backend.threads
        fewer = (self.thread_governor is not None and bool(before and before > 1)
                 and self.backend.set_threads(before - 1))
        self._schedule(step, gate_label)  # the trace row names the threads it ran on
        try:
            return self.backend.step(step.plan)
        finally:
            if fewer:
                self.backend.set_threads(before)

    def _set_threads(self, n: int) -> None:
        """Switch the backend's step threads; what the controller learned at the old count is void."""
        before = self.backend.threads
        if n == before or self._in_flight is not None or not self.backend.set_threads(n):
            return
        # A step's threads share its work: n threads instead of `before` cost before/n as much.
        self.observer.device_changed(cost_factor=before / n if before else None)
        self.trace.note(f"step threads {before} -> {n} at {self.clock() - self.trace.origin:.3f} s")

    def _collect(self, key: int, step: PlannedStep, pending: PendingStep) -> None:
        """A step's results are back: observe it, sample (or take the device's tokens), deliver."""
        try:
            result = pending.wait()
            if self.pipelined and result.token_ids is None:
                raise BackendError(f"{self.backend.name} is pipelined but returned no device-sampled token_ids")
        except Exception as exc:  # noqa: BLE001 - the step's requests fail; the engine goes on
            message = str(exc) if isinstance(exc, BackendError) else f"{type(exc).__name__}: {exc}"
            self._fail_plan(step, message)
            return
        # The backend's own completed time, in both modes: a pipelined step is collected only
        # after the next one is launched, so a host clock read here would count that launch.
        record = self.observer.completed(key, result.duration_s, result.device_duration_s)
        t_done = record.t1 if record is not None else self.clock()
        tokens = self._device_tokens(step, result.token_ids) if self.pipelined else (
            self._sample(step, result.logits, t_done))
        update = self.scheduler.update(step, tokens, t_done)
        for seq, token in update.tokens:
            self._emit(seq, TokenEvent(seq.request.request_id, token, t_done, cached_tokens=seq.n_cached))
        for seq in update.finished:
            self._close(seq, free_slot=True)

    def _drain(self) -> None:
        """Wait for a step still on the device (stopping, or after a failure); its tokens are dropped."""
        if self._in_flight is not None:
            _, _, pending = self._in_flight
            self._in_flight = None
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - its requests are being ended anyway
                log.exception("a step in flight failed while the engine stopped")

    def _device_tokens(self, step: PlannedStep, token_ids: dict[int, int]) -> dict[int, int]:
        return {slot: token_ids[slot] for slot in step.sampled_slots() if slot in token_ids}

    def _prepare_slot(self, seq: Sequence) -> None:
        """A new sequence's cache: its reused prefix kept, the rest dropped (all of it when none is reused)."""
        if seq.n_cached and self.backend.keep_prefix(seq.slot, seq.n_cached):
            return
        self.backend.free_sequence(seq.slot)
        self.scheduler.forget_prefix(seq)

    def _sample(self, step: PlannedStep, logits: dict, t_done: float) -> dict[int, int]:
        """Slot -> next token. A request whose sampling fails ends with that error, alone."""
        tokens = {}
        by_slot = step.seqs or {s.slot: s for s in self.scheduler.running}
        for slot in step.sampled_slots():
            seq = by_slot.get(slot)
            if seq is None or seq.status == Status.FINISHED:
                continue
            try:
                tokens[slot] = sample(logits[slot], seq.request.sampling, self._rngs[seq.request.request_id])
            except Exception as exc:  # noqa: BLE001 - the request's own parameters or a missing row
                self._finish(seq, FinishReason.ERROR, f"sampling failed: {type(exc).__name__}: {exc}", t_done)
        return tokens

    def _emit(self, seq: Sequence, ev: TokenEvent) -> None:
        """Deliver one event; a callback that raises fails its own request."""
        handle = self._handles.get(seq.request.request_id)
        if handle is None:
            return
        try:
            handle._deliver(ev)
        except Exception as exc:  # noqa: BLE001
            log.warning("event callback of %s raised %s: failing that request", seq.request.request_id, exc)
            self._finish(seq, FinishReason.ERROR, f"event callback failed: {type(exc).__name__}: {exc}", ev.t)

    def _fail_plan(self, step: PlannedStep, message: str) -> None:
        slots = {d.seq_id for d in step.plan.decodes} | {c.seq_id for c in step.plan.prefills}
        log.error("step failed (%s); failing %d sequence(s)", message, len(slots))
        # The sequences the step was planned for (a slot may have been reused since).
        planned = [step.seqs[s] for s in slots if s in step.seqs] if step.seqs else [
            s for s in self.scheduler.running if s.slot in slots]
        for seq in planned:
            self._finish(seq, FinishReason.ERROR, message)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None, now: float | None = None,
                free_slot: bool = True) -> None:
        had_slot = seq in self.scheduler.running
        if self.scheduler.finish(seq, reason, self.clock() if now is None else now, error):
            self._close(seq, free_slot=free_slot and had_slot)

    def _close(self, seq: Sequence, free_slot: bool) -> None:
        """A sequence the scheduler has ended: free its cache, record it, tell the caller, forget it."""
        if free_slot and not self.scheduler.keeps_cache(seq.slot):
            self.backend.free_sequence(seq.slot)
        rid = seq.request.request_id
        record = self._record(seq)
        handle = self._handles.pop(rid, None)
        self._seqs.pop(rid, None)
        self._rngs.pop(rid, None)
        if handle is not None:
            _safe_deliver(handle, TokenEvent(rid, None, seq.finished_s, seq.finish_reason, seq.error, seq.n_cached))
            handle._finish(record)

    def _record(self, seq: Sequence) -> RequestRecord:
        record = RequestRecord(
            request_id=seq.request.request_id,
            priority=str(seq.priority),
            tag=seq.request.tag,
            arrival_s=seq.arrival_s,
            prompt_len=seq.prompt_len,
            output_ids=list(seq.output_ids),
            token_times=list(seq.token_times),
            finish_reason=None if seq.finish_reason is None else str(seq.finish_reason),
            error=seq.error,
            finished_s=seq.finished_s,
            n_prefill_chunks=seq.n_prefill_chunks,
            cached_prompt_tokens=seq.n_cached,
            preemptions=seq.preemptions,
            itl_target_s=seq.request.itl_target_s,
            ttft_goal_s=seq.request.ttft_goal_s,
        )
        self.trace.add_request(record)
        return record

    def _on_step(self, rec: StepRecord) -> None:
        if rec.unreachable:
            self.trace.note(_unreachable_note(self.policy))
        self.trace.add_step(rec)
        for hook in self.step_hooks:
            hook(rec)


def _safe_deliver(handle: RequestHandle, ev: TokenEvent) -> None:
    """The final event: a callback that raises now cannot fail the request twice."""
    try:
        handle._deliver(ev)
    except Exception as exc:  # noqa: BLE001
        log.warning("final event callback of %s raised %s", handle.request_id, exc)


def _seed_for(request: Request, base: int) -> int:
    """The request's generator seed. Any integer a client sends (OpenAI allows negative
    seeds) maps to a valid one; without a seed, one derived from the request id."""
    if request.sampling.seed is not None:
        return int(request.sampling.seed) % 2**64
    return (base * 1_000_003 + zlib.crc32(request.request_id.encode())) & 0xFFFFFFFF


def _unreachable_note(policy: PrefillPolicy) -> str:
    target = policy.describe().get("target_ms")
    return (
        f"ITL target {target:.0f} ms is unreachable on this device: even the minimum "
        f"prefill cap misses it (the decode step alone may be slower); guarded steps carry "
        f"at most the minimum chunk, or none where the policy may hold background prefill out"
    )
