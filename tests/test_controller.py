import pytest

from dlfp.controller import (
    CADENCE,
    COMPLETION,
    DLFP,
    UNREACHABLE_AFTER,
    DLFPParams,
    FixedCap,
    Unbounded,
    next_cap,
    parse_policy,
)

PAPER = DLFPParams(target_s=0.080, initial=3072, minimum=1024, maximum=6144, quantum=128)


def test_paper_vector():
    # Section 3.1: a live update from 3072 to 4224 tokens after a 57.51 ms observation.
    assert next_cap(3072, 0.080, 0.05751, PAPER) == 4224
    c = DLFP(PAPER)
    c.observe(0.05751)
    assert c.cap() == 4224


def test_clamps():
    assert next_cap(3072, 0.080, 0.001, PAPER) == 6144  # far below target -> maximum
    assert next_cap(3072, 0.080, 10.0, PAPER) == 1024  # far above target -> minimum


def test_quantum_floors():
    p = DLFPParams(0.1, 64, 8, 512, quantum=16)
    # 64 * 100/90 = 71.1 -> floored to 64, not rounded up to 80
    assert next_cap(64, 0.1, 0.090, p) == 64
    assert next_cap(64, 0.1, 0.070, p) == 80  # 91.4 -> 80
    assert next_cap(64, 0.1, 0.100, p) == 64
    assert next_cap(64, 0.1, 0.200, p) == 32


def test_shrinks_on_slow_grows_on_fast():
    c = DLFP(DLFPParams(0.1, 64, 2, 512, 2))
    c.observe(0.2)
    assert c.cap() == 32
    c.observe(0.05)
    assert c.cap() == 64


def test_reset_returns_to_initial():
    c = DLFP(DLFPParams(0.1, 64, 2, 512, 2))
    c.observe(0.4)
    assert c.cap() == 16
    c.reset()
    assert c.cap() == 64


def test_unreachable_target_settles_at_minimum_and_says_so():
    # The decode step alone (30 ms) is slower than the 20 ms target.
    p = DLFPParams(0.020, 64, 4, 512, 4)
    c = DLFP(p)
    for _ in range(50):
        tokens = c.cap()
        c.observe(0.030 + 0.001 * tokens)
        if c.target_unreachable:
            break
    assert c.cap() == 4
    assert c.target_unreachable
    # It stays put rather than oscillating.
    caps = set()
    for _ in range(20):
        c.observe(0.034)
        caps.add(c.cap())
    assert caps == {4}


def test_reachable_target_is_not_flagged():
    c = DLFP(DLFPParams(0.1, 8, 2, 256, 2))
    for _ in range(3 * UNREACHABLE_AFTER):
        c.observe(0.014 + 0.016 * c.cap())  # a CPU-like cost: 14 ms decode + 16 ms/token
    assert not c.target_unreachable
    assert 2 <= c.cap() <= 6


def test_zero_observation_keeps_cap():
    c = DLFP(PAPER)
    c.observe(0.0)
    assert c.cap() == 3072


def test_bad_params_rejected():
    with pytest.raises(ValueError):
        DLFPParams(0.1, 8, 16, 256, 2)
    with pytest.raises(ValueError):
        DLFPParams(-1, 8, 2, 256, 2)
    with pytest.raises(ValueError):
        FixedCap(0)
    with pytest.raises(ValueError):
        DLFP(PAPER, source="wallclock")


def test_parse_policy():
    assert isinstance(parse_policy("unbounded", PAPER), Unbounded)
    assert parse_policy("unbounded", PAPER).cap() is None
    assert parse_policy("fixed:32", PAPER).cap() == 32
    assert parse_policy("dlfp", PAPER).source == COMPLETION
    assert parse_policy("dlfp-cadence", PAPER).source == CADENCE
    for bad in ("fixed:x", "fixed:-3", "magic"):
        with pytest.raises(ValueError):
            parse_policy(bad, PAPER)


def test_max_growth_limits_only_growth():
    p = DLFPParams(0.1, 8, 1, 256, 1, max_growth=1.25)
    assert next_cap(8, 0.1, 0.02, p) == 10  # x5 asked, x1.25 allowed
    assert next_cap(1, 0.1, 0.02, p) == 2  # always room for one quantum
    assert next_cap(8, 0.1, 0.4, p) == 2  # shrinking is immediate
    assert next_cap(3072, 0.080, 0.05751, PAPER) == 4224  # the paper's law is untouched by default
    with pytest.raises(ValueError):
        DLFPParams(0.1, 8, 1, 256, 1, max_growth=1.0)
