"""Statistics for paired trials: Student-t intervals over per-seed changes.

Each seed runs the baseline and the candidate on the identical workload, so the
per-seed change is the unit of evidence; its mean gets a two-sided Student-t
interval with n - 1 degrees of freedom (with three seeds, df = 2 and the
critical value is 4.303: wide, honestly so).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float | None  # None when n < 2: one trial has no spread to estimate
    high: float | None
    n: int
    df: int
    confidence: float

    def includes(self, value: float) -> bool | None:
        if self.low is None or self.high is None:
            return None
        return self.low <= value <= self.high

    def to_dict(self) -> dict:
        return asdict(self)


def t_interval(values, confidence: float = 0.95) -> Interval:
    """Mean of `values` with its two-sided Student-t interval (df = n - 1)."""
    x = np.asarray([v for v in values if v is not None], dtype=float)
    if x.size == 0:
        raise ValueError("no values for an interval")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = int(x.size)
    mean = float(x.mean())
    if n < 2:
        return Interval(mean, None, None, n, 0, confidence)
    sem = float(x.std(ddof=1)) / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sem
    return Interval(mean, mean - half, mean + half, n, n - 1, confidence)


def relative_change(baseline: float | None, candidate: float | None) -> float | None:
    """(candidate - baseline) / baseline; None where undefined (missing or zero baseline)."""
    if baseline is None or candidate is None or baseline == 0:
        return None
    return (candidate - baseline) / baseline


def paired_differences(baseline: list[float | None], candidate: list[float | None]) -> list[float | None]:
    """Per-trial differences candidate - baseline (None where either is missing)."""
    if len(baseline) != len(candidate):
        raise ValueError(f"paired samples differ in length: {len(baseline)} vs {len(candidate)}")
    return [None if b is None or c is None else c - b for b, c in zip(baseline, candidate)]


def paired_changes(baseline: list[float | None], candidate: list[float | None]) -> list[float | None]:
    """Per-trial relative changes of paired values."""
    if len(baseline) != len(candidate):
        raise ValueError(f"paired samples differ in length: {len(baseline)} vs {len(candidate)}")
    return [relative_change(b, c) for b, c in zip(baseline, candidate)]
