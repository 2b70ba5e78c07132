"""From vLLM's two scheduler calls to policy observations (no vLLM import here).

vLLM calls `schedule()` to plan a step and `update_from_output()` when that step's
output is back. The observer turns those calls into what the policy is fed:

- `completion`: each scheduled step is stamped at schedule time; when its output
  returns, `L = t_done - max(t_scheduled, t_previous_done)`: a step planned ahead
  (async scheduling) cannot start on the device before the previous one is done.
  Empty steps are skipped.
- `cadence`: the interval between consecutive `schedule()` calls after a capped
  step, the paper's proxy, kept only to reproduce it. Under async scheduling
  vLLM plans step k+2 as soon as step k's output is back, while step k+1 runs,
  so the interval charged to step k+2 is the device time of step k+1: one step
  stale, and charged to a step with another cap (the first capped step of a burst
  is charged with the isolated prefill before it).

The async lag: with a queue of two batches, the output of step k arrives after
step k+1 is already planned, so an observation can shape step k+2 at the
earliest. Each stamp therefore carries the cap its step was planned with and the
policy scales that cap (`observe(L, cap=...)`), not the current one: a step
planned before an observation arrived is corrected once, not twice. Stamps from
before the last reset (a moment when nothing decoded) are dropped, so a late
observation cannot move the cap of a new decode burst.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

from dlfp.controller import CADENCE, COMPLETION, PrefillPolicy
from dlfp.trace import StepRecord

# Stamps kept for steps whose output never came back (aborted engine): a bound, not a queue size.
MAX_PENDING = 16


@dataclass
class Stamp:
    t_scheduled: float
    guarded: bool
    cap: int | None
    n_decode: int  # decode tokens (1 + speculative tokens per decoding request)
    n_prefill: int  # prompt tokens of the step
    epoch: int

    @property
    def capped(self) -> bool:
        """The cap governed this step: the steps the policy observes."""
        return self.guarded and self.cap is not None and self.n_prefill > 0

    @property
    def empty(self) -> bool:
        return self.n_decode + self.n_prefill == 0


class StepObserver:
    def __init__(self, policy: PrefillPolicy, clock: Callable[[], float], sink: Callable[[StepRecord], None] | None = None):
        self.policy = policy
        self.clock = clock
        self.sink = sink
        self._pending: dict[Hashable, Stamp] = {}
        self._epoch = 0
        self._call = 0.0  # when the current schedule() call began
        self._prev_call: float | None = None  # when the last non-empty schedule() began (cadence)
        self._prev_capped = False
        self._prev_done: float | None = None  # last completed non-empty step (completion)
        self.last_observed: float | None = None

    def begin(self, guarded: bool) -> int | None:
        """At the start of schedule(): the cadence observation, then the cap (None: vLLM's own budget)."""
        t = self.clock()
        self._call = t
        if self.policy.source == CADENCE and self._prev_capped and self._prev_call is not None:
            self.last_observed = t - self._prev_call
            self.policy.observe(self.last_observed)
        if not guarded:
            self.policy.reset()
            self._epoch += 1
            return None
        return self.policy.cap()

    def scheduled(self, key: Hashable, guarded: bool, cap: int | None, n_decode: int, n_prefill: int) -> Stamp:
        """At the end of schedule(): the step can start on the device from now."""
        stamp = Stamp(self.clock(), guarded, cap, n_decode, n_prefill, self._epoch)
        if stamp.empty:
            self._prev_call, self._prev_capped = None, False
        else:
            self._prev_call, self._prev_capped = self._call, stamp.capped
        if len(self._pending) >= MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = stamp
        return stamp

    def completed(self, key: Hashable) -> float | None:
        """At update_from_output(): the step's completed latency, or None (empty, unknown)."""
        t_done = self.clock()
        stamp = self._pending.pop(key, None)
        if stamp is None or stamp.empty:
            return None
        start = stamp.t_scheduled if self._prev_done is None else max(stamp.t_scheduled, self._prev_done)
        latency = t_done - start
        self._prev_done = t_done
        observed = None
        if self.policy.source == COMPLETION and stamp.capped and stamp.epoch == self._epoch:
            observed = latency
            self.policy.observe(latency, cap=stamp.cap)
        if self.sink is not None:
            self.sink(_record(stamp, start, t_done, latency, observed, self.policy.target_unreachable))
        return latency


def _record(stamp: Stamp, t0: float, t1: float, latency: float, observed: float | None, unreachable: bool) -> StepRecord:
    return StepRecord(
        t0=t0,
        t1=t1,
        duration_s=latency,
        n_decode=stamp.n_decode,
        n_prefill_fg=stamp.n_prefill,  # vLLM has no foreground/background split
        n_prefill_bg=0,
        guarded=stamp.guarded,
        cap=stamp.cap,
        bg_cap=None,
        observed_s=observed,
        unreachable=unreachable,
    )
