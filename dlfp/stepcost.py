"""What a step costs, learned online from the steps the controller observes.

    L ~ a + n * (b + c * pos / 1024)

a: the step without prompt tokens (decodes, launch); b: one prompt token near the
start of a context; c: the extra per prompt token for every 1,024 positions of
context it attends over (a token deep in a long document costs more). Fit by
exponentially weighted least squares with a weak ridge toward zero: forgetting
keeps it current when the cost shifts (another process takes a core), and the
ridge keeps it defined while the cap sits still (then a and b are not separately
identifiable and the fit leans on b, which over- rather than under-predicts a
larger chunk). Units: milliseconds and tokens.
"""
from __future__ import annotations

import numpy as np

POS_SCALE = 1024.0
RIDGE = 1e-3  # weak: any few real observations outweigh it
MIN_PER_TOKEN_MS = 1e-6


class StepCostModel:
    def __init__(self, forgetting: float = 0.95):
        self.forgetting = forgetting
        self._a = np.zeros((3, 3))
        self._b = np.zeros(3)
        self.theta = np.zeros(3)
        self.n_obs = 0

    @staticmethod
    def features(n: float, pos: float) -> np.ndarray:
        return np.array([1.0, n, n * pos / POS_SCALE])

    def update(self, latency_ms: float, n: float, pos: float = 0.0) -> None:
        x = self.features(n, pos)
        f = self.forgetting
        self._a = f * self._a + np.outer(x, x)
        self._b = f * self._b + x * latency_ms
        self.theta = np.linalg.solve(self._a + RIDGE * np.eye(3), self._b)
        self.n_obs += 1

    def predict(self, n: float, pos: float = 0.0) -> float:
        return float(self.features(n, pos) @ self.theta)

    @property
    def base_ms(self) -> float:
        """The step's cost without prompt tokens (never negative)."""
        return max(0.0, float(self.theta[0]))

    def per_token_ms(self, pos: float = 0.0) -> float:
        """Marginal cost of one more prompt token at mean position `pos` (kept positive)."""
        b, c = float(self.theta[1]), float(self.theta[2])
        return max(MIN_PER_TOKEN_MS, b + max(0.0, c) * pos / POS_SCALE)

    def tokens_within(self, budget_ms: float, pos: float = 0.0) -> float:
        """How many prompt tokens fit in a step of `budget_ms` (may be negative)."""
        return (budget_ms - self.base_ms) / self.per_token_ms(pos)
