"""The tail-aware controller (`dlfp`): one cost model times one learned margin.

A guarded step with d decodes gets the largest chunk n (a quantum multiple in [minimum,
maximum]) with predict(n, d) * margin(d) <= T. `predict`: the step-cost model
(dlfp/stepcost.py). `margin(d)`: the quantile of measured / predicted over the window's
chunk steps with d decodes (else all of them, else `prior_spread`) that holds `quantile` of
the window's foreground ITLs, held decode-only steps' too (the cap cannot shrink those: no
ratio; a decode-only step with nothing waiting stays out of the window).
A margin under 1 holds only for chunks up to the largest measured by the steps that set it
(those with d decodes where they shifted it, else the window's); past it the margin is 1,
and where nothing larger fits at 1 the cap is that largest chunk ("measured").
No minimum fits: 0 ("hold") if `zero_cap`, else the minimum; while held, one step in
`probe_every` carries the minimum ("probe") unless a fresh model predicts it above T. A step
that missed T by more than the margin plans the next at its own ratio ("miss": the window
learns a sudden slowdown too slowly). Before a prompt token is measured the decode-only
steps size the chunk ("prior"). A step with prompt tokens still running at `cut_at` x T is
cut (the engine runs its protected decodes alone, rule "cut"): a late step whose time so far
is learned as its cost, a bound from below (learned as nothing, a cost that doubled while
every step was cut at T would stay unlearned, the same chunk planned and cut for good).
"""
from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

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
    # A step with prompt tokens still running at cut_at x T is cut (None: never). A reply's own
    # P99 <= 1.1 T absorbs one ITL up to ~1.25 T, no longer one: such a step has already failed
    # every reply it ends an ITL of, and a cut there only bounds that ITL.
    cut_at: float | None = 1.25
    # While a new turn's prompt loads beside the streams, background prompts and decodes wait
    # (dlfp.scheduler.plan): the turn gets the whole setpoint. False: they share the cap, the
    # turn's prompt first.
    turn_first: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for ok, need, value in ((0.5 <= self.quantile < 1, "quantile in [0.5, 1)", self.quantile),
                                (self.window >= MARGIN_SAMPLES, f"window >= {MARGIN_SAMPLES} steps", self.window),
                                (0.5 <= self.forgetting <= 1, "forgetting in [0.5, 1]", self.forgetting),
                                (self.prior_spread >= 1, "prior_spread >= 1", self.prior_spread),
                                (self.probe_every >= 1, "probe_every >= 1", self.probe_every),
                                (self.cut_at is None or self.cut_at >= 1, "cut_at >= 1 or None", self.cut_at)):
            if not ok:
                raise ValueError(f"need {need}, got {value}")


MARGIN_SAMPLES = 32  # a tail quantile of fewer ratios is their maximum, one unlucky step
BIAS_SAMPLES = 3  # ratios beside a decode count that shift the pooled margin (held: one per probe)
YOUNG_MODEL = 8  # the first steps' ratios measure the model converging, not the device: not kept


class Measured(NamedTuple):  # a guarded step in the margin's window
    decodes: int
    tokens: int  # prompt tokens it carried
    ratio: float | None  # measured / predicted; None: a decode-only step
    itls: int  # foreground ITLs it ended
    late: bool  # it ran over the target


class TailDLFP(PrefillPolicy):
    """Tail-aware DLFP: the largest chunk whose predicted step time times the margin meets T."""

    source = COMPLETION

    def __init__(self, params: TailParams, name: str = "dlfp"):
        self.params = params
        self.name = name
        self.model = StepCostModel(params.forgetting)
        self._window: deque[Measured] = deque(maxlen=params.window)
        self._speed = 1.0  # the device's step cost relative to the first: the product of the cost factors
        self._speeds: dict[float, tuple[StepCostModel, deque]] = {}  # model and window at other speeds
        self._decodes = 1  # decodes of the latest step: the plan's default
        self._position = 0  # where the next prompt chunk starts (its tokens' cost grows with it)
        self._held_asks = 0  # guarded steps asked while held since the last probe
        self._missed: float | None = None  # measured / predicted of the latest step, where it missed T
        self._target_ms = params.target_s * 1e3  # the target of the latest decision
        self.zero_steps = 0  # guarded steps the cap kept free of prompt tokens

    def decide(self, n_decode: int | None = None, target_s: float | None = None,
               position: int | None = None) -> Decision:
        self._decodes = d = n_decode or self._decodes
        self._position = position or 0
        self._target_ms = (target_s or self.params.target_s) * 1e3  # the margin is a ratio: it holds for any T
        margin = self.margin(d)
        missed = self._missed is not None and self._missed > margin
        if missed:  # a step just missed T by more than the margin allows: its own ratio, for one step
            margin = self._missed
        cap, rule, margin = self._plan(d, margin)
        rule = "miss" if missed and rule == "model" else rule
        if cap == 0:
            self._held_asks += 1
            if self._held_asks >= self.params.probe_every and not self._misses(d, fresh=True):
                self._held_asks = 0
                cap, rule = self.params.minimum, "probe"
            else:
                self.zero_steps += 1
        predicted = self.model.predict(cap, d, self._position) if self.model.plannable else None
        cut_ms = self.params.cut_at * self._target_ms if cap and self.params.cut_at else None
        return Decision(cap, rule, d, predicted, margin, self._target_ms / margin, cut_ms, self._position)

    @property
    def plans_turns(self) -> bool:
        return self.params.turn_first

    def _plan(self, d: int, margin: float) -> tuple[int, str, float]:
        """The largest chunk whose prediction times the margin meets T, the rule that says so,
        and the margin it was planned at."""
        p = self.params
        if not self.model.plannable:
            return p.initial, "initial", margin
        planned = self._fitting(d, margin)
        if margin < 1 and planned > (largest := self._largest_measured(d)):
            # A margin under 1 (the model over-predicts) holds for the chunks it was measured on;
            # past them the model's error is not known, and may run the other way
            # (docs/controller.md, rule `measured`): planned at a margin of 1 there.
            at_one = self._fitting(d, 1.0)
            if at_one < largest:  # the largest measured chunk still fits under the learned margin
                return max(p.minimum, largest // p.quantum * p.quantum), "measured", margin
            planned, margin = at_one, 1.0
        if not planned:
            return (0, "hold", margin) if p.zero_cap else (p.minimum, "minimum", margin)
        # The prior errs far small on a GPU, never large enough to trust above `initial`.
        return (planned, "model", margin) if self.model.ready else (min(planned, p.initial), "prior", margin)

    def _largest_measured(self, d: int) -> int:
        """The largest chunk among the steps whose ratios set `margin(d)`: `_own_chunks(d)`, else
        the whole window's. Small chunks' ratios say nothing of a larger chunk's
        (docs/controller.md, rule `measured`)."""
        return max((s.tokens for s in self._own_chunks(d) or self._window), default=0)

    def _own_chunks(self, d: int) -> list[Measured]:
        """The window's chunk steps with `d` decodes where BIAS_SAMPLES of them shape `margin(d)`
        (empty: the pooled window's ratios set it alone)."""
        own = [s for s in self._window if s.decodes == d and s.ratio is not None]
        return own if len(own) >= BIAS_SAMPLES else []

    def _fitting(self, d: int, margin: float) -> int:
        """The largest chunk (a quantum multiple up to `maximum`) whose prediction times the margin
        meets T; 0 where not even the minimum does."""
        p = self.params
        room = self.model.tokens_within(self._target_ms / margin, d, self._position)
        return 0 if room < p.minimum else max(p.minimum, min(p.maximum, math.floor(room / p.quantum) * p.quantum))

    def margin(self, n_decode: int | None = None) -> float:
        """The ratio chunk steps exceed on 1 - q of the window's ITLs less the late decode-only
        steps' ones. Over the steps with `n_decode` decodes, else over all steps times their
        median ratio over all steps' (once BIAS_SAMPLES measured it), else the prior."""
        d = self._decodes if n_decode is None else n_decode
        same = [s for s in self._window if s.decodes == d]
        for steps in (same, self._window):
            chunks = [s for s in steps if s.ratio is not None]
            if len(chunks) >= MARGIN_SAMPLES:
                spare = (1 - self.params.quantile) * sum(s.itls for s in steps)
                spare -= sum(s.itls for s in steps if s.ratio is None and s.late)
                q = min(1.0, max(0.0, 1 - spare / sum(s.itls for s in chunks)))
                # The smallest ratio whose ITLs, with every smaller one's, reach q of them.
                margin = float(np.quantile([s.ratio for s in chunks], q, weights=[s.itls for s in chunks],
                                           method="inverted_cdf"))
                if steps is same or not (mine := [s.ratio for s in self._own_chunks(d)]):
                    return margin
                return margin * float(np.median(mine) / np.median([s.ratio for s in chunks]))
        return self.params.prior_spread

    def _misses(self, d: int, fresh: bool = False) -> bool:
        """Even the minimum chunk's typical step (no margin) is predicted above T; `fresh`: by a
        pass measured within `probe_every` steps (a stale one must not keep background out for
        good after a neighbour leaves: probes refresh it)."""
        m, expected = self.model, self.model.predict(self.params.minimum, d, self._position)
        stale = fresh and (m.seq_measured_at is None or m.n_obs - m.seq_measured_at >= self.params.probe_every)
        return not stale and expected is not None and expected > self._target_ms

    def observe(self, latency_s: float, cap: int | None = None, shape: StepShape | None = None,
                cut: bool = False) -> None:
        n = shape.n_prefill if shape is not None else cap
        if latency_s <= 0 or n is None or n < 0:
            return  # nothing to learn from
        if shape is not None and shape.n_decode > 0:  # else (unknown, or none beside a budgeted chunk): as before
            self._decodes = shape.n_decode
        d, ms, itls = self._decodes, latency_s * 1e3, shape.itls if shape is not None else 1
        x = shape.mean_prefill_position if shape is not None else 0.0
        # A ratio to the prior (no prompt token measured yet) says nothing about the model's error.
        predicted = self.model.predict(n, d, x) if self.model.ready or n == 0 else None
        late = cut or ms > self._target_ms
        self._missed = ms / predicted if predicted and late else None
        # A decode-only step with nothing waiting (the cap allowed prompt tokens, none ran) says
        # nothing of a chunk, and the cap decided nothing in it: a chat streaming alone would
        # age every ratio out of the window. A held step (cap 0) is the cap's doing: it ages it.
        idle = n == 0 and cap != 0
        if not idle and (n == 0 or (predicted and self.model.n_obs >= YOUNG_MODEL)):
            self._window.append(Measured(d, n, ms / predicted if n else None, itls, late))
        self.model.update(ms, n, d, shape.n_chunks if shape is not None else None, x)

    def reset(self) -> None:
        self._held_asks = 0  # what was learned is the device's and model's, not one turn's: kept

    def device_changed(self, cost_factor: float | None = None) -> None:
        # Each speed's model and window are kept for a return to it (thread counts flap; scaling
        # at every change ratcheted). A new speed: the costs times the factor (more threads: the
        # old costs, the next steps teach the speed-up) and a fresh window; no factor: afresh.
        fresh = deque(maxlen=self.params.window)
        if not (cost_factor and cost_factor > 0):
            self._speeds.clear()
            self.model, self._window = StepCostModel(self.params.forgetting), fresh
        else:
            self._speeds[self._speed] = (self.model, self._window)
            self._speed = round(self._speed * cost_factor, 6)
            old, (self.model, self._window) = self.model, self._speeds.pop(self._speed, (None, fresh))
            if self.model is None:  # a speed not seen before
                self.model = copy.deepcopy(old) if old.ready else StepCostModel(self.params.forgetting)
                self.model.scale(max(1.0, cost_factor))
        self.reset()

    @property
    def target_unreachable(self) -> bool:
        return self.model.ready and self._misses(self._decodes)
