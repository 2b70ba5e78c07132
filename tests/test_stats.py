"""Statistics of paired trials and percentiles, against values worked by hand."""
import math

import pytest

from dlfp.metrics import percentile
from dlfp.stats import paired_changes, relative_change, t_interval


def test_t_interval_of_the_papers_three_reductions():
    # The paper's paired P99 ITL reductions: 24.8%, 30.1%, 28.2% -> mean 27.7%,
    # CI 21.0-34.3%. By hand: sd = sqrt(0.001442 / 2) = 0.026851, sem = 0.015503,
    # t(0.975, df=2) = 4.302653, half-width = 0.066703.
    iv = t_interval([0.248, 0.301, 0.282])
    assert iv.n == 3 and iv.df == 2
    assert iv.mean == pytest.approx(0.277, abs=1e-9)
    assert iv.low == pytest.approx(0.277 - 0.066703, abs=2e-6)
    assert iv.high == pytest.approx(0.277 + 0.066703, abs=2e-6)
    # The paper's 21.0-34.3% came from unrounded reductions: agree to its last digit.
    assert iv.low == pytest.approx(0.210, abs=1e-3) and iv.high == pytest.approx(0.343, abs=1e-3)


def test_t_interval_five_values_and_confidence():
    iv = t_interval([1, 2, 3, 4, 5])
    half = 2.776445 * math.sqrt(2.5) / math.sqrt(5)  # t(0.975, 4) * sd / sqrt(n)
    assert (iv.low, iv.high) == pytest.approx((3 - half, 3 + half), abs=1e-5)
    assert iv.includes(3) and not iv.includes(5)
    narrower = t_interval([1, 2, 3, 4, 5], confidence=0.90)
    assert narrower.low > iv.low and narrower.high < iv.high


def test_t_interval_edge_cases():
    one = t_interval([0.2])
    assert one.mean == 0.2 and one.low is None and one.high is None and one.includes(0.2) is None
    same = t_interval([0.1, 0.1, 0.1])
    assert same.low == pytest.approx(0.1) and same.high == pytest.approx(0.1)
    assert t_interval([None, 1.0, 3.0]).n == 2  # missing values are left out, not zeros
    with pytest.raises(ValueError):
        t_interval([])
    with pytest.raises(ValueError):
        t_interval([1, 2], confidence=1.5)


def test_paired_changes():
    assert paired_changes([100.0, 200.0], [75.0, 220.0]) == pytest.approx([-0.25, 0.10])
    assert paired_changes([0.0, None], [1.0, 2.0]) == [None, None]
    assert relative_change(50.0, 50.0) == 0.0
    with pytest.raises(ValueError):
        paired_changes([1.0], [1.0, 2.0])


def test_percentiles_on_ties_and_tiny_samples():
    assert percentile([5, 5, 5, 5], 99) == 5
    assert percentile([7], 50) == 7 and percentile([7], 99) == 7
    assert percentile([1, 2], 50) == pytest.approx(1.5)
    assert percentile([1, 2], 99) == pytest.approx(1.99)
    # Linear interpolation: rank 0.9 * 4 = 3.6 between 2 and 10.
    assert percentile([1, 2, 2, 2, 10], 90) == pytest.approx(6.8)
    assert percentile([1, 2, 2, 2, 10], 50) == 2
    assert percentile([], 99) is None
