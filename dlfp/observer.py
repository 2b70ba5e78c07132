"""One step observer: what the policy is fed, for every engine dlfp steers.

Two calls bracket every step, whoever runs it: `begin()` + `scheduled()` when the
step is planned, `completed()` when its output is back. dlfp's owned-loop engine
calls them around its synchronous `backend.step`; the vLLM plug-in calls them from
`schedule()` and `update_from_output()`. The observer turns them into what the
policy is told:

- `completion` (dlfp's signal): the step's completed time. A synchronous backend
  measures it around the device call and passes it in; otherwise it is
  `L = t_done - max(t_scheduled, t_previous_done)`: a step planned ahead (vLLM's
  async scheduling) cannot start on the device before the previous one is done.
- `cadence` (the paper's proxy, kept only to reproduce it): the interval between
  consecutive `begin()` calls after a capped step. Under async scheduling the
  next call comes as soon as the previous step's output is back, while another
  step runs, so the interval measures the wrong step.

A step is *guarded* when a protected (foreground) sequence decodes in it: every
guarded step's completion is fed to the policy with its cap and shape (the
paper's law uses only the *capped* ones, where prompt tokens joined under a cap:
`trace.is_capped`, decided once; a cost-learning policy reads the decode-only
cost from the rest). The cadence proxy follows capped steps. A step is *budgeted* when isolated background prefill ran
under the preemption budget: those steps feed the budget's own policy.

Async lag: an observation of step k can shape step k+2 at the earliest, so each
stamp carries the cap its step was planned with and the policy scales that cap
(`observe(L, cap=...)`): a step planned before an observation arrived is
corrected once, not twice. Stamps from before the last reset (a moment when no
protected sequence decoded) are dropped, so a late observation cannot move the
cap of a new decode burst.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Hashable

from dlfp.metrics import ITL_GOAL_TOLERANCE
from dlfp.policy import CADENCE, COMPLETION, Decision, PrefillPolicy, StepShape
from dlfp.trace import CONTENTION, StepRecord, is_capped

# Stamps kept for steps whose output never came back (aborted engine): a bound, not a queue size.
MAX_PENDING = 16


@dataclass
class Stamp:
    t_scheduled: float  # the step may start on the device from here
    guarded: bool
    cap: int | None
    shape: StepShape
    epoch: int
    n_prefill_bg: int = 0  # of shape.n_prefill; engines without classes report 0
    bg_cap: int | None = None  # the preemption budget's cap in force
    governor: str | None = None  # the thermal governor's decision for this step
    threads: int | None = None  # the backend's step threads (None: not under our control)
    n_decode_held: int = 0  # background decodes the cap kept out of the step
    decision: Decision | None = None  # why a guarded step has its cap
    rerun: bool = False  # the decodes of a step that was cut, alone: its ITLs were the cut step's

    @property
    def capped(self) -> bool:
        return is_capped(self.guarded, self.cap, self.shape.n_prefill)

    @property
    def budgeted(self) -> bool:
        return not self.guarded and self.n_prefill_bg > 0 and self.bg_cap is not None

    @property
    def empty(self) -> bool:
        return self.shape.n_decode + self.shape.n_prefill == 0


class StepObserver:
    def __init__(
        self,
        policy: PrefillPolicy,
        clock: Callable[[], float],
        sink: Callable[[StepRecord], None] | None = None,
        budget: PrefillPolicy | None = None,
    ):
        self.policy = policy
        self.budget = budget  # sizes isolated background chunks against the preemption budget
        self.clock = clock
        self.sink = sink
        self._pending: dict[Hashable, Stamp] = {}
        self._epoch = 0
        self._call = 0.0  # when the current begin() came
        self._prev_call: float | None = None  # when the last non-empty step's begin() came (cadence)
        self._prev_capped = False
        self._prev_done: float | None = None  # last completed non-empty step (completion)
        self.last_observed: float | None = None
        self.decision: Decision | None = None  # the policy's latest decision (None before a guarded step)

    # -- planning ----------------------------------------------------------
    def begin(self, guarded: bool, n_decode: int | None = None, target_s: float | None = None,
              turn_loading: bool = False, position: int | None = None) -> int | None:
        """Before planning: the cadence observation, then the cap (None: no cap for this step).
        `n_decode`: the decodes the step will carry, where the caller knows them; `target_s`: the
        tightest ITL target the streaming requests named (None: the policy's); `turn_loading`: a
        foreground prompt loads beside them, so a cap of 0 makes it wait (the record says so);
        `position`: where the step's first prompt chunk would start, where known."""
        t = self.clock()
        self._call = t
        self.last_observed = None
        if self.policy.source == CADENCE and self._prev_capped and self._prev_call is not None:
            self.last_observed = t - self._prev_call
            self.policy.observe(self.last_observed)
        if not guarded:
            self.policy.reset()
            self._epoch += 1
            return None
        decision = self.policy.decide(n_decode, target_s, position)
        if turn_loading and decision.rule == "hold":
            decision = replace(decision, rule="wait")
        self.decision = decision
        return decision.cap

    def cut_after_s(self, guarded: bool, n_prefill: int) -> float | None:
        """How long the step just planned may run before it is cut (None: it runs whole):
        only a guarded step with prompt tokens, under a decision that names a deadline."""
        d = self.decision
        if not guarded or n_prefill == 0 or d is None or d.cut_ms is None:
            return None
        return d.cut_ms / 1e3

    def watch_within_s(self, threads: int = 1) -> float | None:
        """How long into the step just planned a cut for contention still pays: while its
        decodes, rerun alone on one thread fewer, are predicted to end within the replies' goal
        of 1.1 T (the decision's decode-only time times `threads` / (`threads` - 1): threads
        rarely scale perfectly, so a bound), and at least for half of T (dlfp/contention.py
        says why); None: no decision to read it from."""
        d = self.decision
        if d is None or d.setpoint_ms is None or d.margin is None:
            return None
        target_ms = d.setpoint_ms * d.margin
        rerun_ms = d.decode_ms * threads / max(threads - 1, 1) if d.decode_ms is not None else math.inf
        return max(target_ms / 2, ITL_GOAL_TOLERANCE * target_ms - rerun_ms) / 1e3

    def after_cut(self) -> int:
        """The step just planned was cut: the next runs its protected decodes alone (cap 0)."""
        d = self.decision
        self.decision = Decision(0, "cut", d.n_decode if d is not None else None)
        return 0

    def budget_cap(self) -> int | None:
        """The cap for isolated background prefill this step (None: no budget)."""
        return self.budget.cap() if self.budget is not None else None

    def scheduled(self, key: Hashable, guarded: bool, cap: int | None, shape: StepShape, *,
                  n_prefill_bg: int = 0, bg_cap: int | None = None, governor: str | None = None,
                  threads: int | None = None, n_decode_held: int = 0) -> Stamp:
        """After planning: the step can start on the device from now. An empty step
        (nothing to run) breaks the cadence chain and is never completed."""
        rerun = guarded and self.decision is not None and self.decision.rule == "cut"
        stamp = Stamp(self.clock(), guarded, cap, shape, self._epoch, n_prefill_bg, bg_cap, governor, threads,
                      n_decode_held, self.decision if guarded else None, rerun)
        if stamp.empty:
            self._prev_call, self._prev_capped = None, False
            return stamp
        self._prev_call, self._prev_capped = self._call, stamp.capped
        if len(self._pending) >= MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = stamp
        return stamp

    def device_changed(self, cost_factor: float | None = None) -> None:
        """The device's speed changed under the policies (fewer threads): steps in flight
        belong to the old device, and what the policies learned from it holds no more
        (`cost_factor`: the expected change of every step's cost, where known)."""
        self._epoch += 1
        self._prev_call, self._prev_capped = None, False
        self.policy.device_changed(cost_factor)
        if self.budget is not None:
            self.budget.device_changed(cost_factor)

    # -- completion --------------------------------------------------------
    def completed(self, key: Hashable, duration_s: float | None = None,
                  device_duration_s: float | None = None, cut: str | None = None) -> StepRecord | None:
        """The step's output is back. `duration_s`: the completed time where the backend
        measured it (a synchronous call); otherwise it is taken from the stamps. `cut`: why
        the step was cut (dlfp.trace: DEADLINE, CONTENTION, ARRIVAL); nothing of it ran.
        The policy learns from a step cut at its deadline (its time so far, a bound from
        below); not from one cut for contention, whose time says nothing of the threads
        the next steps run on."""
        t_done = self.clock()
        stamp = self._pending.pop(key, None)
        if stamp is None:
            return None
        start = stamp.t_scheduled if self._prev_done is None else max(stamp.t_scheduled, self._prev_done)
        latency = duration_s if duration_s is not None else t_done - start
        self._prev_done = t_done
        observed = self.last_observed if self.policy.source == CADENCE else None
        current = stamp.epoch == self._epoch
        if self.policy.source == COMPLETION and stamp.guarded and current and not stamp.rerun and cut != CONTENTION:
            # Decode-only guarded steps too: a cost-learning policy reads the base cost
            # from them (the paper's law ignores steps without prompt tokens).
            observed = latency
            # `cut` only where it is so: a policy that issues no deadline need not know the word.
            self.policy.observe(latency, cap=stamp.cap, shape=stamp.shape, **({"cut": True} if cut else {}))
        if self.budget is not None and stamp.budgeted and not cut:
            self.budget.observe(latency, cap=stamp.bg_cap, shape=stamp.shape)
        record = self._record(stamp, start, t_done, latency, observed, device_duration_s, cut)
        if self.sink is not None:
            self.sink(record)
        return record

    def _record(self, stamp: Stamp, t0: float, t1: float, latency: float, observed: float | None,
                device_duration_s: float | None, cut: str | None = None) -> StepRecord:
        ran = 0 if cut else 1  # a cut step's prompt tokens run again later: counted then
        return StepRecord(
            t0=t0,
            t1=t1,
            duration_s=latency,
            n_decode=stamp.shape.n_decode,
            n_prefill_fg=ran * (stamp.shape.n_prefill - stamp.n_prefill_bg),
            n_prefill_bg=ran * stamp.n_prefill_bg,
            n_prefill_cut=(1 - ran) * stamp.shape.n_prefill,
            cut_by=cut,
            guarded=stamp.guarded,
            cap=stamp.cap,
            bg_cap=stamp.bg_cap,
            observed_s=observed,
            unreachable=self.policy.target_unreachable,
            device_duration_s=device_duration_s,
            governor=stamp.governor,
            threads=stamp.threads,
            n_decode_held=stamp.n_decode_held,
            **decision_fields(stamp.decision),
        )


def decision_fields(d: Decision | None) -> dict:
    """The decision record as a step trace row carries it."""
    if d is None:
        return {}
    return {"rule": d.rule, "predicted_ms": d.predicted_ms, "margin": d.margin, "setpoint_ms": d.setpoint_ms,
            "cut_ms": d.cut_ms, "position": d.position, "decode_ms": d.decode_ms}


def step_shape(step) -> StepShape:
    """The shape of a scheduler's PlannedStep: its plan's decode positions and prompt chunks,
    and how many of its decodes are protected (the foreground ITLs it ends)."""
    plan = step.plan
    return plan_shape([d.position for d in plan.decodes], [(c.start, len(c.token_ids)) for c in plan.prefills],
                      step.n_decode_protected)


def plan_shape(decode_positions: list[int], chunks: list[tuple[int, int]],
               n_protected: int | None = None) -> StepShape:
    """A step's shape from its decode positions and its prompt chunks as (start, n_tokens);
    a chunk covers positions start .. start+n-1, whose sum is n*start + n(n-1)/2."""
    prefill_sum = sum(n * start + n * (n - 1) // 2 for start, n in chunks)
    return StepShape(
        n_decode=len(decode_positions),
        n_prefill=sum(n for _, n in chunks),
        prefill_position_sum=prefill_sum,
        decode_position_sum=sum(decode_positions),
        n_chunks=len(chunks),
        n_protected=n_protected,
    )
