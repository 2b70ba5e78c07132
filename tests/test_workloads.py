"""Workload specs, open-loop arrivals and exact-token prompts."""
import numpy as np
import pytest

from dlfp.metrics import SLO
from dlfp.sequence import BACKGROUND, FOREGROUND
from dlfp.workloads.arrivals import arrival_times
from dlfp.workloads.schedule import WARMUP_TAG, build_schedule
from dlfp.workloads.specs import SPECS, get_spec, parse_slo
from dlfp.workloads.tokens import fingerprint, make_prompts, usable_ids


def test_same_seed_same_schedule_and_different_seed_differs():
    assert arrival_times(50, 2.0, 801) == arrival_times(50, 2.0, 801)
    assert arrival_times(50, 2.0, 801) != arrival_times(50, 2.0, 802)


def test_poisson_mean_rate_and_exponential_gaps():
    t = np.asarray(arrival_times(20_000, 2.0, 7))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert (len(t) - 1) / t[-1] == pytest.approx(2.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    regular = np.diff(arrival_times(20_000, 2.0, 7, burstiness=4.0))
    assert regular.mean() == pytest.approx(0.5, rel=0.03) and regular.std() / regular.mean() < 0.6


def test_arrival_edge_cases():
    assert arrival_times(0, 1.0, 1) == []
    assert arrival_times(3, float("inf"), 1) == [0.0, 0.0, 0.0]
    for bad in (dict(n=-1, rate=1.0), dict(n=3, rate=0.0), dict(n=3, rate=1.0, burstiness=0)):
        with pytest.raises(ValueError):
            arrival_times(seed=1, **bad)


def test_prompts_are_exact_deterministic_and_nonmatching():
    lengths = [5, 40, 17, 1]
    a = make_prompts(lengths, 49152, seed=3)
    assert a == make_prompts(lengths, 49152, seed=3)
    assert a != make_prompts(lengths, 49152, seed=4)
    assert [len(p) for p in a] == lengths
    low, high = usable_ids(49152)
    assert all(low <= t < high for p in a for t in p)
    assert len({p[0] for p in a}) == len(a)  # no two prompts share even one leading token
    shared = make_prompts([10, 12], 49152, seed=3, shared_prefix=4)
    assert shared[0][:4] == shared[1][:4]
    assert fingerprint(a) == fingerprint([list(p) for p in a]) != fingerprint(shared)
    with pytest.raises(ValueError):
        make_prompts([3], 49152, seed=1, shared_prefix=3)


def test_paper_shapes_and_scaling_keeps_ratios():
    agent = get_spec("agent")
    assert (agent.foreground.input_len, agent.foreground.output_len) == (16384, 256)
    assert agent.slo == SLO(5.0, 0.035, 14.0)
    small = agent.scaled(0.125)
    assert (small.foreground.input_len, small.foreground.output_len) == (2048, 32)
    assert small.scale == 0.125
    assert {"chat", "rag", "agent", "decode-heavy", "laptop", "low-interference"} <= set(SPECS)
    assert get_spec("low-interference").gate.min_reduction is None  # do no harm
    with pytest.raises(ValueError):
        get_spec("nope")
    with pytest.raises(ValueError):
        agent.scaled(0)


def test_with_load_keeps_background_in_proportion():
    laptop = get_spec("laptop")
    fg = laptop.foreground
    bg = next(c for c in laptop.classes if c.priority == BACKGROUND)
    loaded = laptop.with_load(requests=fg.count * 2, rate=fg.rate * 2)
    bg2 = next(c for c in loaded.classes if c.priority == BACKGROUND)
    assert loaded.foreground.count == fg.count * 2 and bg2.count == bg.count * 2
    assert bg2.rate == pytest.approx(bg.rate * 2)


def test_parse_slo_overrides():
    slo = parse_slo("ttft=2.5,itl=40", SLO(5.0, 0.035, 14.0))
    assert slo == SLO(2.5, 0.040, 14.0)
    assert parse_slo("e2el=none", slo).e2el_s is None
    for bad in ("foo=1", "ttft=abc"):
        with pytest.raises(ValueError):
            parse_slo(bad, slo)


def test_schedule_is_identical_per_seed_and_accounts_tokens():
    spec = get_spec("laptop").scaled(0.1)
    a, b = build_schedule(spec, 801, 49152), build_schedule(spec, 801, 49152)
    assert a == b and a.fingerprint == b.fingerprint
    assert build_schedule(spec, 802, 49152).fingerprint != a.fingerprint
    assert len(a.warmup) == spec.warmup and all(p.tag == WARMUP_TAG for p in a.warmup)
    assert [p.arrival_s for p in a.measured] == sorted(p.arrival_s for p in a.measured)
    assert len(a.measured) == sum(c.count for c in spec.classes)
    fg = [p for p in a.measured if p.priority == FOREGROUND]
    assert all(len(p.prompt_ids) == spec.foreground.input_len and p.max_tokens == spec.foreground.output_len
               for p in fg)
    assert a.expected_output_tokens == sum(c.count * c.output_len for c in spec.classes)
    req = a.measured[0].to_request()
    assert req.ignore_eos and req.sampling.temperature == 0.0 and req.request_id == a.measured[0].request_id
    ids = [p.request_id for p in a.warmup + a.measured]
    assert len(set(ids)) == len(ids)
    firsts = [p.prompt_ids[0] for p in a.warmup + a.measured]
    assert len(set(firsts)) == len(firsts)


def test_text_prompts_are_windows_with_distinct_openings():
    pool = list(range(1000, 1300))
    a = make_prompts([50, 400, 20], 49152, seed=5, pool=pool)
    assert a == make_prompts([50, 400, 20], 49152, seed=5, pool=pool)
    assert [len(p) for p in a] == [50, 400, 20]
    assert len({tuple(p[:2]) for p in a}) == 3  # no shared prefix
    for p in a:  # consecutive windows of the (cycled) pool
        assert all(b == (1000 + ((x - 1000 + 1) % 300)) for x, b in zip(p, p[1:]))
    shared = make_prompts([10, 12], 49152, seed=5, shared_prefix=4, pool=pool)
    assert shared[0][:4] == shared[1][:4]
    with pytest.raises(ValueError):
        make_prompts([5] * 3, 49152, seed=5, pool=[7, 7, 7])  # one distinct opening only
