"""Open-loop arrival times, defined as `vllm bench serve` defines them.

Gaps between requests are gamma-distributed with shape `burstiness` and scale
1 / (rate * burstiness): burstiness 1 is a Poisson process (exponential gaps),
lower values are burstier, higher values more regular; the mean rate is `rate`
either way. Arrivals are a fixed schedule: they never wait for completions.
"""
from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, seed: int | list[int], burstiness: float = 1.0) -> list[float]:
    """Seconds from the start of the run at which each of `n` requests arrives.

    The first request arrives at 0; `rate=inf` sends everything at once.
    """
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (use inf for all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()
