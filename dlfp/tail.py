"""The tail-aware controller (`dlfp`): one cost model times one learned margin.

A guarded step with d decodes gets the largest chunk n (a quantum multiple in [minimum,
maximum]) with predict(n, d) * margin(d) <= T: `predict` from dlfp/stepcost.py, `margin(d)` a
quantile of measured / predicted over recent steps. Each rule of the decision record
(`model`, `prior`, `initial`, `measured`, `miss`, `faster`, `hold`, `minimum`, `probe`) is
stated where it applies; docs/controller.md gives the measurement behind each.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from dlfp.margin import MARGIN_SAMPLES, Margin, Measured
from dlfp.paper import PaperParams
from dlfp.policy import COMPLETION, Decision, PrefillPolicy, StepShape
from dlfp.stepcost import StepCostModel


@dataclass(frozen=True)
class TailParams(PaperParams):
    """The paper's bounds, and what the tail-aware controller learns and aims at."""

    quantile: float = 0.99  # ITL quantile aimed at the target
    window: int = 128  # recent guarded steps whose ITLs and ratios give the margin
    forgetting: float = 0.9  # share of the cost estimate an observation keeps (memory ~1/(1-f) steps)
    prior_spread: float = 1.5  # the margin until enough steps have been measured
    zero_cap: bool = False  # may keep background prefill out of guarded steps entirely
    probe_every: int = 32  # while the cap is 0: one minimum-size step every N guarded steps
    # A step with prompt tokens still running at cut_at x T is cut (None: never): a reply's own
    # P99 <= 1.1 T absorbs one ITL up to ~1.25 T, so past it the step has failed its replies.
    cut_at: float | None = 1.25
    turn_first: bool = True  # a new turn's prompt loads with background held out (False: shared)
    # Under this median measured / predicted over the latest `faster_steps` chunk steps the
    # device is taken to have got faster and the model is scaled to it (None: never).
    faster_below: float | None = 0.7
    faster_steps: int = 16  # in a row: a loaded CPU runs bursts of 8 fast steps, not a faster device
    # A streaming reply that has had the ITLs over its target its own P99 absorbs (one for a
    # 64-token reply) plans the steps it streams in against target / spent_factor (1: never):
    # a second one would fail its goal, and the margin lets ~1 - q of the steps over T.
    spent_factor: float = 1.1

    def __post_init__(self) -> None:
        super().__post_init__()
        for ok, need, value in ((0.5 <= self.quantile < 1, "quantile in [0.5, 1)", self.quantile),
                                (self.window >= MARGIN_SAMPLES, f"window >= {MARGIN_SAMPLES} steps", self.window),
                                (0.5 <= self.forgetting <= 1, "forgetting in [0.5, 1]", self.forgetting),
                                (self.prior_spread >= 1, "prior_spread >= 1", self.prior_spread),
                                (self.probe_every >= 1, "probe_every >= 1", self.probe_every),
                                (self.spent_factor >= 1, "spent_factor >= 1", self.spent_factor),
                                (1 <= self.faster_steps <= self.window, "faster_steps in [1, window]",
                                 self.faster_steps),
                                (self.cut_at is None or self.cut_at >= 1, "cut_at >= 1 or None", self.cut_at),
                                (self.faster_below is None or 0 < self.faster_below < 1,
                                 "faster_below in (0, 1) or None", self.faster_below)):
            if not ok:
                raise ValueError(f"need {need}, got {value}")


YOUNG_MODEL = 8  # the first steps' ratios measure the model converging, not the device: not kept


class TailDLFP(PrefillPolicy):
    """Tail-aware DLFP: the largest chunk whose predicted step time times the margin meets T."""

    source = COMPLETION

    def __init__(self, params: TailParams, name: str = "dlfp"):
        self.params, self.name, self.plans_turns = params, name, params.turn_first
        self.spent_factor = params.spent_factor
        self.model = StepCostModel(params.forgetting)
        self.margins = Margin(params.quantile, params.window, params.prior_spread)
        self._speed = 1.0  # the device's step cost relative to the first: the product of the cost factors
        self._speeds: dict[float, tuple[StepCostModel, Margin]] = {}  # model and margin at other speeds
        self._decodes = 1  # decodes of the latest step: the plan's default
        self._position = 0  # where the next prompt chunk starts (its tokens' cost grows with it)
        self._held_asks = 0  # guarded steps asked while held since the last probe
        self._probe_setpoint: float | None = None  # the setpoint of the probe in flight (ms)
        self._probe_next = False  # the latest probe fitted: a held next step probes again
        self._missed: float | None = None  # measured / predicted of the latest step, where it missed T
        self._faster = False  # the model was scaled to a faster device since the latest decision
        self._target_ms = params.target_s * 1e3  # the target of the latest decision
        self.zero_steps = 0  # guarded steps the cap kept free of prompt tokens

    def decide(self, n_decode: int | None = None, target_s: float | None = None,
               position: int | None = None) -> Decision:
        self._decodes = d = n_decode or self._decodes
        self._position = position or 0
        self._target_ms = (target_s or self.params.target_s) * 1e3  # the margin is a ratio: it holds for any T
        margin = self.margin(d)
        # "miss": a step that missed T by more than the margin plans the next at its own ratio
        # (the window learns a sudden slowdown too slowly).
        missed = self._missed is not None and self._missed > margin
        cap, rule, margin = self._plan(d, self._missed if missed else margin)
        if rule == "model" and (missed or self._faster):
            rule = "miss" if missed else "faster"
        self._faster = False
        probe_next, self._probe_next, self._probe_setpoint = self._probe_next, False, None
        if cap == 0:  # "probe": one held step in probe_every carries the minimum, unless sure to miss
            self._held_asks += 1
            if (probe_next or self._held_asks >= self.params.probe_every) and not self._misses(d, fresh=True):
                self._held_asks = 0
                cap, rule = (not self.model.ready and self._measuring(d)) or self.params.minimum, "probe"
                self._probe_setpoint = self._target_ms / margin
            else:
                self.zero_steps += 1
        predicted = self.model.predict(cap, d, self._position) if self.model.plannable else None
        cut_ms = self.params.cut_at * self._target_ms if cap and self.params.cut_at else None
        return Decision(cap, rule, d, predicted, margin, self._target_ms / margin, cut_ms, self._position,
                        self.model.base(d))

    def _plan(self, d: int, margin: float) -> tuple[int, str, float]:
        """The cap, the rule that set it, and the margin it was planned at."""
        p = self.params
        if not self.model.plannable:
            return p.initial, "initial", margin
        planned = self._fitting(d, margin)
        if margin < 1 and planned > (largest := self.margins.largest_measured(d)):
            # "measured": a margin under 1 holds for the chunk sizes that measured it; past them
            # the model's error is unknown and may run the other way, so they plan at 1.
            at_one = self._fitting(d, 1.0)
            if at_one < largest:  # the largest measured chunk still fits under the learned margin
                return max(p.minimum, largest // p.quantum * p.quantum), "measured", margin
            planned, margin = at_one, 1.0
        if not planned:
            return (0, "hold", margin) if p.zero_cap else (p.minimum, "minimum", margin)
        if self.model.ready:
            return planned, "model", margin
        # "prior": no prompt token measured yet; at most `initial` (the prior errs far small on
        # a GPU), at least a chunk that measures a token where one fits T (`_measuring`).
        return min(max(planned, self._measuring(d)), p.initial), "prior", margin

    def _measuring(self, d: int) -> int:
        """The smallest chunk that measures a prompt token's cost (two tokens: one beside the
        decodes measures only its pass) where it is predicted within T without the margin; else 0."""
        p = self.params
        n = math.ceil(max(p.minimum, 2) / p.quantum) * p.quantum
        fits = n <= p.maximum and (self.model.predict(n, d, self._position) or math.inf) <= self._target_ms
        return n if fits else 0

    def _fitting(self, d: int, margin: float) -> int:
        """The largest quantum multiple up to `maximum` whose prediction times the margin meets T;
        0 where not even the minimum does."""
        p = self.params
        room = self.model.tokens_within(self._target_ms / margin, d, self._position)
        return 0 if room < p.minimum else max(p.minimum, min(p.maximum, math.floor(room / p.quantum) * p.quantum))

    def margin(self, n_decode: int | None = None) -> float:
        """The learned margin for `n_decode` decodes (the latest step's by default)."""
        return self.margins.of(self._decodes if n_decode is None else n_decode)

    def _misses(self, d: int, fresh: bool = False) -> bool:
        """The minimum chunk's step, with no margin, is predicted above T; `fresh`: by a pass
        measured within `probe_every` steps (a stale one must not hold background out for good)."""
        m, expected = self.model, self.model.predict(self.params.minimum, d, self._position)
        stale = fresh and (m.seq_measured_at is None or m.n_obs - m.seq_measured_at >= self.params.probe_every)
        return not stale and expected is not None and expected > self._target_ms

    def observe(self, latency_s: float, cap: int | None = None, shape: StepShape | None = None,
                cut: bool = False) -> None:
        """Learn a completed step. A cut step's time so far is its cost, a bound from below."""
        n = shape.n_prefill if shape is not None else cap
        if latency_s <= 0 or n is None or n < 0:
            return  # nothing to learn from
        if shape is not None and shape.n_decode > 0:
            self._decodes = shape.n_decode
        d, ms, itls = self._decodes, latency_s * 1e3, shape.itls if shape is not None else 1
        x = shape.mean_prefill_position if shape is not None else 0.0
        # A ratio to the prior (no prompt token measured yet) says nothing about the model's error.
        predicted = self.model.predict(n, d, x) if self.model.ready or n == 0 else None
        late = cut or ms > self._target_ms
        # A probe measured within its setpoint fits now, however the model and the margin price
        # it: a held next step probes again, so they learn from steps in a row.
        fitted = self._probe_setpoint is not None and n > 0 and not cut and ms <= self._probe_setpoint
        self._probe_next, self._probe_setpoint = fitted, None
        self._missed = ms / predicted if predicted and late else None
        # A decode-only step with nothing waiting (cap not 0, no prompt token ran) is not the
        # cap's doing: kept out, or a chat streaming alone would age every ratio away.
        idle = n == 0 and cap != 0
        if not idle and (n == 0 or (predicted and self.model.n_obs >= YOUNG_MODEL)):
            self.margins.add(Measured(d, n, ms / predicted if n else None, itls, late))
        self.model.update(ms, n, d, shape.n_chunks if shape is not None else None, x)
        self._follow_speed_up()

    def _follow_speed_up(self) -> None:
        """"faster": where the latest `faster_steps` steps in the window all carried prompt tokens
        and ran at a median ratio under `faster_below`, the device got faster than the model can
        learn (one-token chunks beside one decode never measure the base alone): the model is
        scaled by that ratio and the window's ratios by its inverse, keeping the spread. Not
        before the margin has learned (at a new speed the model is a scaled guess, and its
        first ratios measure the guess converging, not the device)."""
        ratio = self.margins.latest_ratio(self.params.faster_steps) if self.margins.learned else None
        if ratio is not None and ratio < (self.params.faster_below or 0.0):
            self.model.scale(ratio)
            self.margins.rescale(ratio)
            self._faster = True

    def reset(self) -> None:
        self._held_asks = 0  # what was learned is the device's and model's, not one turn's: kept

    def device_changed(self, cost_factor: float | None = None) -> None:
        """Each speed keeps its model and margin for a return to it. A new speed: the costs times
        the factor (never scaled down: threads rarely scale perfectly) and a fresh margin; either
        way the margin learned so far is the prior. No factor: everything learned afresh."""
        p = self.params
        if not (cost_factor and cost_factor > 0):
            self._speeds = {}
            self.model, self.margins = StepCostModel(p.forgetting), Margin(p.quantile, p.window, p.prior_spread)
            return self.reset()
        prior = self.margin()
        self._speeds[self._speed] = (self.model, self.margins)
        self._speed = round(self._speed * cost_factor, 6)
        fresh = Margin(p.quantile, p.window, prior)
        old, (self.model, self.margins) = self.model, self._speeds.pop(self._speed, (None, fresh))
        self.margins.prior = prior
        if self.model is None:  # a speed not seen before
            self.model = copy.deepcopy(old) if old.plannable else StepCostModel(p.forgetting)
            self.model.scale(max(1.0, cost_factor))
        self.reset()

    @property
    def target_unreachable(self) -> bool:
        return self.model.ready and self._misses(self._decodes)
