"""The paper's law: equation (2) of DLFP, bit-exact,

    c_next = clamp(floor_q(c * T / L), c_min, c_max)

timed by completion (`dlfp-paper`) or by the paper's scheduler-call proxy
(`dlfp-cadence`), with its own parameters (PaperParams).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from dlfp.policy import (
    COMPLETION, SOURCES, UNREACHABLE_AFTER, Decision, PrefillPolicy, StepShape,
)


@dataclass(frozen=True)
class PaperParams:
    target_s: float
    initial: int
    minimum: int
    maximum: int
    quantum: int = 1
    # Largest factor the cap may grow by in one observation (None: unlimited, the
    # paper's law). Shrinking is never limited. On a noisy CPU one lucky fast step
    # would otherwise multiply the cap and the next step overshoots the target.
    max_growth: float | None = None

    def __post_init__(self) -> None:
        if self.max_growth is not None and self.max_growth <= 1:
            raise ValueError(f"max_growth must be > 1, got {self.max_growth}")
        if self.target_s <= 0:
            raise ValueError(f"target must be positive, got {self.target_s}")
        if self.quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {self.quantum}")
        if not 1 <= self.minimum <= self.initial <= self.maximum:
            raise ValueError(
                f"need 1 <= minimum <= initial <= maximum, got "
                f"{self.minimum}, {self.initial}, {self.maximum}"
            )

    @classmethod
    def of(cls, params) -> "PaperParams":
        """The paper's fields of any parameters that carry them (TailParams extends these)."""
        return cls(**{f.name: getattr(params, f.name) for f in fields(cls)})


def next_cap(cap: int, target_s: float, latency_s: float, p: PaperParams) -> int:
    """Equation (2): proportional resize, floored to the quantum, then clamped."""
    if latency_s <= 0:
        return cap  # a zero-length observation carries no information
    scaled = cap * target_s / latency_s
    if p.max_growth is not None:
        scaled = min(scaled, max(cap * p.max_growth, cap + p.quantum))  # always room for one quantum
    # Round before flooring so 3072*80/57.51 style products are not lost to float noise.
    floored = math.floor(round(scaled, 6) / p.quantum) * p.quantum
    return max(p.minimum, min(p.maximum, floored))


class PaperDLFP(PrefillPolicy):
    """Decode-Latency Feedback Prefill as published: equation (2) on every capped step."""

    def __init__(self, params: PaperParams, source: str = COMPLETION):
        if source not in SOURCES:
            raise ValueError(f"unknown observation source {source!r}; one of {SOURCES}")
        self.params = params
        self.source = source
        self.name = "dlfp-paper" if source == COMPLETION else "dlfp-cadence"
        self._cap = params.initial
        self._rule = "initial"
        self._misses_at_min = 0

    def decide(self, n_decode: int | None = None, target_s: float | None = None,
               position: int | None = None) -> Decision:
        # The published law has one target, its own: a request's target is not an input of equation (2).
        return Decision(self._cap, self._rule, n_decode, setpoint_ms=self.params.target_s * 1e3)

    def observe(self, latency_s: float, cap: int | None = None, shape: StepShape | None = None,
                cut: bool = False) -> None:
        if shape is not None and shape.n_prefill == 0:
            return  # a step without prompt tokens says nothing about the cap (equation (2) as published)
        p = self.params
        # Scale the cap the observed step ran with: scaling a cap that a later
        # observation already moved would apply one correction twice.
        base = self._cap if cap is None else cap
        at_min = base == p.minimum
        self._cap, self._rule = next_cap(base, p.target_s, latency_s, p), "paper"
        # A miss at the minimum means even the smallest chunk cannot meet the
        # target (often: the decode alone is slower than the target).
        self._misses_at_min = self._misses_at_min + 1 if at_min and latency_s > p.target_s else 0

    def reset(self) -> None:
        self._cap, self._rule = self.params.initial, "initial"
        # Unreachability is a property of the device, not of one burst: keep the count.

    @property
    def target_unreachable(self) -> bool:
        return self._misses_at_min >= UNREACHABLE_AFTER
