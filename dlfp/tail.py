"""The tail-aware controller (`dlfp`): a quantile of the guarded steps held at the target.

It learns the step's cost online (dlfp/stepcost.py) and aims a chosen quantile of the
guarded steps, not their mean, at the target; it may hold background prefill out
entirely (cap 0). Its parameters (TailParams) extend the paper's bounds.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from dlfp.paper import PaperParams
from dlfp.policy import (
    COMPLETION, UNREACHABLE_AFTER, Decision, PrefillPolicy, StepShape, describe_params,
)
from dlfp.stepcost import StepCostModel


@dataclass(frozen=True)
class TailParams(PaperParams):
    """The paper's bounds, and what the tail-aware controller learns and aims at."""

    quantile: float = 0.99  # step-time quantile aimed at the target
    window: int = 128  # recent guarded steps whose spread (weighted by their foreground ITLs) sizes the setpoint
    forgetting: float = 0.9  # share of the cost estimate an observation keeps (memory ~1/(1-f) steps)
    prior_spread: float = 1.5  # assumed quantile/mean ratio until the window has data
    zero_cap: bool = False  # may keep background prefill out of guarded steps entirely
    probe_every: int = 32  # while the cap is 0: one minimum-size step every N guarded steps

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.5 <= self.quantile < 1:
            raise ValueError(f"quantile must be in [0.5, 1), got {self.quantile}")
        if self.window < 8:
            raise ValueError(f"window must be >= 8 steps, got {self.window}")
        if not 0.5 <= self.forgetting <= 1:
            raise ValueError(f"forgetting must be in [0.5, 1], got {self.forgetting}")
        if self.prior_spread < 1:
            raise ValueError(f"prior_spread must be >= 1, got {self.prior_spread}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")


WARMUP_OBSERVATIONS = 8  # before this many, the cost model is young: growth stays limited
MIN_CHUNK_MEMORY = 16  # latest guarded steps that carried the minimum chunk, per decode count (time / prediction)
MIN_CHUNK_MEASURED = 4  # of those, needed before their median corrects the prediction
MIN_RATIOS = 32  # residuals needed before the observed spread replaces the prior
MAX_SPREAD = 8.0


def weighted_quantile(samples, q: float) -> float:
    """The smallest value whose weight, with every smaller value's, reaches q of the total:
    `samples` as (value, weight). Equal weights give the order statistic ceil(q*n)."""
    ordered = sorted(samples)
    need, seen = q * sum(w for _, w in ordered), 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= need - 1e-9:
            return value
    return ordered[-1][0]


class TailDLFP(PrefillPolicy):
    """Tail-aware DLFP: hold a quantile of the guarded steps at the target.

    Each observed guarded step teaches a cost model (dlfp/stepcost.py: the
    decode-only cost plus a cost per prompt token) and leaves the ratio of its
    time to what the model predicted, weighted by the foreground ITLs the step
    ends (a step with two chats streaming is two of the user's ITLs). The
    setpoint is T divided by the `quantile` of the recent ratios, so the ITLs'
    spread, not their mean, is what meets T. The cap is the number of prompt
    tokens the model fits under the setpoint, at once, with no climb: what was
    learned survives `reset()`, so each foreground turn starts at the right cap.
    A step that misses T also shrinks the cap by equation (2) at once.

    When even the minimum chunk would break T at the quantile (and `zero_cap`),
    the cap is 0: no background prompt token joins a guarded step (counted in
    `zero_steps`). "Would break" is the model's prediction for the minimum chunk
    times the median ratio of measured to predicted time over the steps that
    recently carried it beside as many decodes, against the setpoint: a small
    step's cost is not linear in its tokens on a CPU, so a model fitted to larger
    steps overpredicts it and would keep background out of steps that hold T. The
    ratio, not the measured time, is kept: the model follows a device that slows
    down, so an old ratio stays true where an old time would not. The decode-only
    steps observed meanwhile keep the base cost current, so the cap returns when
    the device is free again; one guarded step in `probe_every` carries the
    minimum chunk in case the per-token cost moved, where the model says that step
    may meet T (else at the next step that may).
    Before a prompt token is measured, the decode-only steps size the first chunk
    (dlfp/stepcost.py's prior), never above `initial`.
    """

    source = COMPLETION

    def __init__(self, params: TailParams, name: str = "dlfp"):
        self.params = params
        self.name = name
        self.model = StepCostModel(params.forgetting)
        self._ratios: deque[tuple[float, int]] = deque(maxlen=params.window)  # (ratio, ITLs)
        self._set(params.initial, "initial")
        self._misses_at_min = 0
        self._asked_at_zero = 0
        self._min_ratios: dict[int, deque[float]] = {}  # decodes beside the minimum chunk -> its ratios
        self._reflex: int | None = None  # the miss reflex's cut, in force until the next observation
        self._reflex_rule = "reflex"  # what decided that cut (reflex, or hold/minimum where it fell below)
        self._probe_skipped = False  # a due probe was not run: the model says the minimum misses T
        self.zero_steps = 0  # guarded steps the cap kept free of prompt tokens

    def decide(self, n_decode: int | None = None) -> Decision:
        if n_decode and n_decode != self.model.decodes:
            self.model.decodes = n_decode  # the step's decodes cost too: plan for this many
            if self.model.plannable:
                # Replanned for the new count, but not above the cut the last miss made:
                # that cut holds until the next observation.
                planned, rule = self._planned()
                if self._reflex is not None and self._reflex < planned:
                    planned, rule = self._reflex, self._reflex_rule
                self._set(planned, rule)
        if self._cap > 0:
            self._probe_skipped = False
            return self._plan
        self._asked_at_zero += 1
        if self._asked_at_zero >= self.params.probe_every:  # a probe is due
            if self._probe_may_meet_target():
                self._asked_at_zero = 0
                self._probe_skipped = False
                return self._decision(self.params.minimum, "probe")  # does the minimum chunk fit again?
            self._probe_skipped = True  # kept due: the next step that may meet T runs it
        self.zero_steps += 1
        return self._plan

    def _set(self, cap: int, rule: str) -> None:
        """The cap for the coming guarded steps, and the decision record that explains it: the
        model's prediction and the margin as they stood when it was planned."""
        self._cap = cap
        self._plan = self._decision(cap, rule)

    def _decision(self, cap: int, rule: str) -> Decision:
        d = self.model.decodes
        predicted = self.model.predict(cap, d) if self.model.plannable else None
        spread = self.spread()
        return Decision(cap, rule, d, predicted, spread, self.params.target_s * 1e3 / spread)

    def _probe_may_meet_target(self) -> bool:
        """A probe is a step the setpoint says no to; skip it where it would surely miss T:
        the model, with a pass per sequence measured within the last `probe_every`
        observations, predicts the minimum chunk's step above T (beside two decodes at a tight
        target even one prompt token can break it; the decode-only steps with two decodes keep
        s measured there). Where s is stale (or was never measured) the probe runs: refreshing
        it is what probes are for, and a stale cost must not keep background out for good
        (after a noisy neighbour leaves)."""
        age = self.model.seq_age()
        if age is None or age >= self.params.probe_every:
            return True
        expected = self.model.predict(self.params.minimum)
        return expected is None or expected <= self.params.target_s * 1e3

    def observe(self, latency_s: float, cap: int | None = None, shape: StepShape | None = None) -> None:
        p = self.params
        ran_with = self._cap if cap is None else cap
        n = shape.n_prefill if shape is not None else ran_with
        if latency_s <= 0 or n < 0:
            return  # nothing to learn from
        self._reflex = None  # this observation replaces any earlier cut
        latency_ms = latency_s * 1e3
        decodes = shape.n_decode if shape is not None and shape.n_decode > 0 else None
        # A ratio to the prior (no prompt token measured yet) says nothing about the model's spread.
        predicted = self.model.predict(n, decodes) if self.model.ready or n == 0 else None
        if predicted and self.model.n_obs >= WARMUP_OBSERVATIONS:
            # Weighted by the foreground ITLs the step ends: the user's P99 is over ITLs, and a
            # step with two chats streaming is two of them (a quantile over steps counted it once).
            self._ratios.append((latency_ms / predicted, shape.itls if shape is not None else 1))
        self.model.update(latency_ms, n, decodes, shape.n_chunks if shape is not None else None)
        if 0 < n <= p.minimum and predicted:
            ratios = self._min_ratios.setdefault(self.model.decodes, deque(maxlen=MIN_CHUNK_MEMORY))
            ratios.append(latency_ms / predicted)
        if n == 0:  # a decode-only guarded step: the base moved, so may the cap
            if self.model.plannable and (not self.model.ready or self._cap == 0 or ran_with == 0):
                self._set(*self._planned())
            return
        missed = latency_s > p.target_s
        self._misses_at_min = self._misses_at_min + 1 if n <= p.minimum and missed else 0
        setpoint_ms = self.setpoint_s() * 1e3
        new, rule = self._planned(setpoint_ms)
        if missed:  # reflex: equation (2) on the tokens the step carried
            cut = math.floor(n * p.target_s / latency_s / p.quantum) * p.quantum
            if cut < new:
                new, rule = cut, "reflex"
            if new < p.minimum:
                new, rule = (0, "hold") if self._hold_out(setpoint_ms) else (p.minimum, "minimum")
            self._reflex, self._reflex_rule = new, rule
        if self.model.n_obs < WARMUP_OBSERVATIONS:
            growth = p.max_growth or 2.0
            limit = max(int(max(ran_with, 1) * growth), ran_with + p.quantum)
            if limit < new:
                new, rule = limit, "warmup"
        self._set(new, rule)

    def spread(self) -> float:
        """The recent steps' `quantile` as a multiple of the model's prediction."""
        p = self.params
        if len(self._ratios) < MIN_RATIOS:
            return p.prior_spread
        return min(MAX_SPREAD, max(1.0, weighted_quantile(self._ratios, p.quantile)))

    def setpoint_s(self) -> float:
        return self.params.target_s / self.spread()

    def _planned(self, setpoint_ms: float | None = None) -> tuple[int, str]:
        """Tokens the model fits under the setpoint, floored to the quantum and clamped; and the rule."""
        p = self.params
        if not self.model.plannable:
            return p.initial, "initial"
        setpoint_ms = self.setpoint_s() * 1e3 if setpoint_ms is None else setpoint_ms
        room = self.model.tokens_within(setpoint_ms)
        if room < p.minimum:
            return (0, "hold") if self._hold_out(setpoint_ms) else (p.minimum, "minimum")
        planned = max(p.minimum, min(p.maximum, math.floor(room / p.quantum) * p.quantum))
        # From the prior (no prompt token measured): at most `initial`, which may be sized
        # for the device (the prior errs far small on a GPU).
        return (planned, "model") if self.model.ready else (min(planned, p.initial), "prior")

    def _hold_out(self, setpoint_ms: float) -> bool:
        """Keep background prefill out of guarded steps: allowed, past the warm-up, and the
        minimum chunk's step misses the setpoint as predicted and as measured. While the cap is
        0 only probes add measurements; the model follows the decode-only steps, so the cap
        returns as soon as the corrected prediction says the minimum fits again."""
        p = self.params
        if not p.zero_cap or self.model.n_obs < WARMUP_OBSERVATIONS:
            return False
        expected = self.model.predict(p.minimum)
        # Corrected by the steps that carried it beside as many decodes: how far the model
        # errs on a one-token chunk depends on what rides beside it, so a correction learned
        # beside one decode does not hold beside two.
        ratios = self._min_ratios.get(self.model.decodes, ())
        if expected is not None and len(ratios) >= MIN_CHUNK_MEASURED:
            expected *= sorted(ratios)[len(ratios) // 2]
        return expected is None or expected > setpoint_ms

    def reset(self) -> None:
        # What was learned is a property of the device and model, not of one turn:
        # keep it, and start the next turn at the cap it gives.
        self._asked_at_zero = 0
        self._reflex = None
        self._set(*self._planned())

    def device_changed(self, cost_factor: float | None = None) -> None:
        # A different device (thread count). With a factor, the costs learned so far,
        # scaled by it, are the prior (the right cap at once, as after a turn's reset;
        # going to fewer threads this errs on the safe side, since threads rarely scale
        # perfectly); without one, learn afresh from the initial cap with the warm-up
        # growth limit, as at the start of a run. A faster device (more threads) keeps
        # the old costs: threads rarely scale perfectly, so scaling the costs down by the
        # thread ratio would promise more than the threads give; the next steps teach the
        # speed-up safely. The spread is relearned either way.
        if cost_factor and cost_factor > 0 and self.model.ready:
            self.model.scale(max(1.0, cost_factor))
        else:
            self.model = StepCostModel(self.params.forgetting)
        self._ratios.clear()
        self._min_ratios.clear()
        self._misses_at_min = 0
        self.reset()

    @property
    def target_unreachable(self) -> bool:
        # Measured (the minimum chunk missed T that often in a row) or predicted (a due probe
        # was not run because the model says it would miss T).
        return self._misses_at_min >= UNREACHABLE_AFTER or self._probe_skipped

    def state(self) -> dict:
        """What the controller has learned (for traces and the study)."""
        m = self.model
        return {"cap": self._cap, "spread": self.spread(), "setpoint_ms": self.setpoint_s() * 1e3,
                "base_ms": m.base_ms, "seq_ms": m.seq_ms, "token_ms": m.token_ms, "observations": m.n_obs,
                "zero_steps": self.zero_steps}

    def describe(self) -> dict:
        return describe_params(self.name, self.source, self.params)

def make_budget_policy(budget_s: float, initial: int, max_tokens: int) -> PrefillPolicy:
    """Sizes isolated background chunks so a step stays within the preemption budget.

    The same cost learning as `dlfp`, aimed at the budget: a foreground message that
    arrives meanwhile waits for at most about one such step. Never 0, since isolated
    background prefill must progress.
    """
    initial = max(1, min(initial, max_tokens))
    return TailDLFP(TailParams(budget_s, initial, 1, max_tokens, 1, quantile=0.9, zero_cap=False),
                    name="budget")
