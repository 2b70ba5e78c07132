"""The learned margin: how far guarded steps run over the cost model's prediction.

A ratio measured / predicted per guarded step with prompt tokens, kept with the foreground
ITLs the step ended, over the latest `window` guarded steps; the margin for d decodes is the
quantile of the ratios that lets 1 - q of the ITLs run over (docs/controller.md, "The
margin"). The tail controller (dlfp/tail.py) plans predict(n, d) x margin(d) <= T.
"""
from __future__ import annotations

import itertools
import statistics
from collections import deque
from typing import NamedTuple

from dlfp.metrics import weighted_quantile

MARGIN_SAMPLES = 32  # a tail quantile of fewer ratios is their maximum, one unlucky step
BIAS_SAMPLES = 3  # ratios beside a decode count that shift the pooled margin (held: one per probe)


class Measured(NamedTuple):  # a guarded step in the margin's window
    decodes: int
    tokens: int  # prompt tokens it carried
    ratio: float | None  # measured / predicted; None: a decode-only step
    itls: int  # foreground ITLs it ended
    late: bool  # it ran over the target


class Margin:
    def __init__(self, quantile: float, window: int, prior: float):
        self.quantile = quantile
        self.steps: deque[Measured] = deque(maxlen=window)
        self.prior = prior  # the margin until the window has enough chunk steps
        self.chunk_steps = 0  # chunk steps added since it began

    def add(self, step: Measured) -> None:
        self.steps.append(step)
        self.chunk_steps += step.ratio is not None

    def of(self, d: int) -> float:
        """The chunk steps' ratio that lets 1 - q of the window's ITLs run over, less those of late
        decode-only steps (held: no cap shrinks them). Over the steps with `d` decodes, else over
        all steps times their median ratio over all steps' (once BIAS_SAMPLES measured it), else
        the prior."""
        same = [s for s in self.steps if s.decodes == d]
        for steps in (same, self.steps):
            chunks = [s for s in steps if s.ratio is not None]
            if len(chunks) >= MARGIN_SAMPLES:
                spare = (1 - self.quantile) * sum(s.itls for s in steps)
                spare -= sum(s.itls for s in steps if s.ratio is None and s.late)
                q = min(1.0, max(0.0, 1 - spare / sum(s.itls for s in chunks)))
                margin = weighted_quantile([s.ratio for s in chunks], [s.itls for s in chunks], q)
                if steps is same or not (mine := [s.ratio for s in self.own_chunks(d)]):
                    return margin
                return margin * (statistics.median(mine) / statistics.median([s.ratio for s in chunks]))
        return self.prior

    @property
    def learned(self) -> bool:
        """MARGIN_SAMPLES chunk steps measured since this margin began (at the start, or at a
        speed not seen before): its ratios measure the device, not a model still converging."""
        return self.chunk_steps >= MARGIN_SAMPLES

    def own_chunks(self, d: int) -> list[Measured]:
        """The chunk steps with `d` decodes, where there are enough to shape the margin for `d`."""
        own = [s for s in self.steps if s.decodes == d and s.ratio is not None]
        return own if len(own) >= BIAS_SAMPLES else []

    def largest_measured(self, d: int) -> int:
        """The largest chunk among the steps whose ratios set the margin for `d`."""
        return max((s.tokens for s in self.own_chunks(d) or self.steps), default=0)

    def latest_ratio(self, steps: int) -> float | None:
        """The median ratio of the latest `steps` steps, where each carried prompt tokens."""
        ratios = [s.ratio for s in itertools.islice(reversed(self.steps), steps) if s.ratio is not None]
        return statistics.median(ratios) if len(ratios) == steps else None

    def rescale(self, factor: float) -> None:
        """Every ratio divided by `factor`: the model was scaled by it, the spread about it kept."""
        self.steps = deque((s._replace(ratio=s.ratio and s.ratio / factor) for s in self.steps),
                           maxlen=self.steps.maxlen)
