"""What a step costs, learned online from the guarded steps the controller observes.

    L ~ a + (d - 1) * k + n * k

a: a guarded step with one decode that carries no prompt token, an
exponentially weighted average of the decode-only steps, each less k per extra
decode (on a 2-core CPU a second decode costs about as much as a prompt token:
14 ms for one decode, 28 ms for two, measured on the default model; one base for
every decode count mispredicted every step after the count changed; a base per
decode count would go stale for the counts not seen while the device slows). k:
the cost of one prompt token now, an exponentially weighted average of (L - a(d)) / n over
the steps that carried n prompt tokens. k follows the prompt's position (a token
deep in a long document attends over more cells) and a slower device (another
process taking a core) within a few steps, because each observation measures it
directly; a full least-squares fit of a, k and a position slope swung wildly
whenever the cap sat still (a and k are then not separately identifiable), so
the simpler estimator won. One sample may move k by at most a factor of 3: a
single preempted step is the spread's business (the quantile setpoint), not the
cost's. Until a decode-only step is seen, a is 0 and k is L / n: the paper's
proportional law. Units: milliseconds and tokens.
"""
from __future__ import annotations

CLIP = 3.0  # one sample moves k toward at most CLIP times (or 1/CLIP of) its current value
MIN_SHARE = 0.1  # (L - a) is taken as at least this share of L: a noisy base never makes k <= 0


class StepCostModel:
    def __init__(self, forgetting: float = 0.95):
        self.keep = forgetting  # share of the old estimate an observation keeps
        self.base_ms: float | None = None  # decode-only step time with one decode
        self.token_ms: float | None = None
        self.n_obs = 0
        self.decodes = 1  # the decode count of the latest step: the default for predictions

    def update(self, latency_ms: float, n: int, n_decode: int | None = None) -> None:
        self.n_obs += 1
        d = self.decodes = self.decodes if n_decode is None else n_decode
        if n <= 0:
            one = max(latency_ms - (d - 1) * (self.token_ms or 0.0), MIN_SHARE * latency_ms)
            self.base_ms = one if self.base_ms is None else self._mix(self.base_ms, one)
            return
        sample = max(latency_ms - (self.base(d) or 0.0), MIN_SHARE * latency_ms) / n
        if self.token_ms is None:
            self.token_ms = sample
        else:
            sample = min(CLIP * self.token_ms, max(self.token_ms / CLIP, sample))
            self.token_ms = self._mix(self.token_ms, sample)

    def base(self, n_decode: int | None = None) -> float | None:
        """Decode-only step time with `n_decode` decodes (None: none seen yet)."""
        d = self.decodes if n_decode is None else n_decode
        if self.base_ms is None:
            return None
        return max(0.0, self.base_ms + (d - 1) * (self.token_ms or 0.0))

    def scale(self, factor: float) -> None:
        """Every cost times `factor` (the device got that much slower); the rest is kept."""
        if self.base_ms is not None:
            self.base_ms *= factor
        if self.token_ms is not None:
            self.token_ms *= factor

    def _mix(self, old: float, new: float) -> float:
        return self.keep * old + (1 - self.keep) * new

    @property
    def ready(self) -> bool:
        return self.token_ms is not None

    def predict(self, n: int, n_decode: int | None = None) -> float | None:
        base = self.base(n_decode)
        if n > 0 and self.token_ms is None:
            return None
        if n == 0 and base is None:
            return None
        return (base or 0.0) + n * (self.token_ms or 0.0)

    def tokens_within(self, budget_ms: float) -> float:
        """How many prompt tokens fit in a step of `budget_ms` beside `decodes` decodes (may be negative)."""
        assert self.token_ms is not None, "no capped step observed yet"
        return (budget_ms - (self.base() or 0.0)) / self.token_ms
