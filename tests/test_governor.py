"""The thermal governor: unit checks, then driven through the engine on the SIMULATED
backend (a latency model on a virtual clock, not a device) with a scripted
temperature series (also simulated: no sensor is read)."""
import statistics

import pytest

from dlfp.sim import SimBackend, SimCost, VirtualClock
from dlfp.paper import PaperDLFP
from dlfp.tail import TailParams
from dlfp.devices.governor import CLEAR, ThermalGovernor
from dlfp.profiles import load_profile
from dlfp.devices.reading import Reading, unavailable
from dlfp.engine import Engine, EngineConfig
from dlfp.sequence import BACKGROUND, FOREGROUND, Request

HOT = (15.0, 35.0)  # scripted: 95 C inside this window of virtual seconds, 60 C outside
LIMIT_C = 90.0
PARAMS = TailParams(0.1, 8, 2, 256, 2)
END_S = HOT[1] + 12.0


def zone(temp_c):
    return [Reading("thermal", "thermal_zone0", {"type": "x86_pkg_temp", "temp_c": temp_c})]


def scripted(series):
    """A readings source that returns the next item of a list on every call."""
    it = iter(series)
    return lambda: next(it)


def test_hold_reasons():
    g = ThermalGovernor(lambda: [], limit_c=80, battery_min_percent=20)
    assert g.hold_reason(zone(79.0)) is None
    assert "81.0 C > 80.0 C" in g.hold_reason(zone(81.0))
    assert "throttling" in g.hold_reason([Reading("nvml", "nvml:0", {"temp_c": 50.0, "throttling": True})])
    battery = Reading("battery", "BAT0", {"percent": 15.0, "plugged": False})
    assert "on battery at 15%" in g.hold_reason([battery])
    assert g.hold_reason([Reading("battery", "BAT0", {"percent": 15.0, "plugged": True})]) is None
    assert g.hold_reason([unavailable("thermal", "thermal", "no zones")]) is None  # no data: no hold


def test_duty_cycle_hysteresis_and_recovery():
    temps = [95.0] * 4 + [88.0] * 4 + [86.0] * 4
    g = ThermalGovernor(scripted([zone(t) for t in temps]), limit_c=90, duty=0.25, period_s=1.0,
                        hysteresis_c=3.0, poll_s=0.0)
    decisions = [g(now) for now in (0.0, 0.1, 0.3, 0.9, 1.0, 1.2, 1.5, 1.9, 2.0, 2.1, 2.5, 3.5)]
    allow = [a for a, _ in decisions]
    # Held from t=0: on for the first quarter of each second, off for the rest.
    assert allow[:8] == [True, True, False, False, True, True, False, False]
    assert decisions[2][1].startswith("duty 25% off: thermal:thermal_zone0 95.0 C")
    # 88 C is under the limit but not 3 C under it: still held. 86 C clears the hold.
    assert allow[8:] == [True, True, True, True] and decisions[-1] == (True, CLEAR)
    assert [reason is None for _, reason in g.transitions] == [False, True]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ThermalGovernor(lambda: [], 80, duty=1.5)
    with pytest.raises(ValueError):
        ThermalGovernor(lambda: [], 80, period_s=0)


def test_profiles_carry_governor_limits():
    for name in ("cpu-laptop", "phone", "h200", "a100-paper"):
        p = load_profile(name)
        g = ThermalGovernor.for_profile(p, source=lambda: [])
        assert 40 <= g.limit_c <= 100 and 0 <= g.battery_min_percent < 100


def run_hot_session(hot=HOT):
    """SIMULATED: the sim backend's latency model on a virtual clock, scripted temperatures."""
    clock = VirtualClock()
    # No attention term: a prompt token costs the same at any depth, so background tokens/s
    # before and after the heat compare directly.
    backend = SimBackend(SimCost(attention_s=0.0), clock=clock, context=4096)
    engine = Engine(backend, PaperDLFP(PARAMS), EngineConfig(preemption_budget_s=0.5), clock=clock.now)
    temperature = lambda: 95.0 if hot[0] <= clock.t < hot[1] else 60.0  # noqa: E731
    governor = ThermalGovernor(lambda: zone(temperature()), limit_c=LIMIT_C, duty=0.25, period_s=1.0)
    engine.background_gate = governor
    engine.start()
    fg = engine.submit(Request(list(range(3, 40)), 4000, FOREGROUND, ignore_eos=True, request_id="fg"))
    engine.step_hooks.append(lambda rec: rec.t1 > END_S and fg.cancel())  # the chat ends at END_S
    bgs = [engine.submit(Request([1 + (i + j) % 900 for j in range(4000)], 4, BACKGROUND, request_id=f"bg{i}"))
           for i in range(2)]
    fg_rec = fg.result(timeout=120)
    engine.shutdown(abort_pending=True)
    return engine, governor, fg_rec, bgs


def window_rate(steps, a, b):
    return sum(s.n_prefill_bg for s in steps if a <= s.t0 < b) / (b - a)


def window_itls(record, a, b):
    t = record.token_times
    return [y - x for x, y in zip(t, t[1:]) if a <= x < b]


def test_governor_slows_background_and_spares_the_foreground():
    engine, governor, fg, _ = run_hot_session()
    steps = engine.trace.steps
    assert fg.finish_reason == "abort" and fg.token_times[-1] > END_S  # the chat spans the whole series
    before = (5.0, HOT[0])
    hot = (HOT[0] + 1.0, HOT[1])
    after = (HOT[1] + 1.0, HOT[1] + 10.0)
    rate = {name: window_rate(steps, *w) for name, w in (("before", before), ("hot", hot), ("after", after))}
    assert rate["before"] > 0
    assert rate["hot"] < 0.5 * rate["before"]  # the duty cycle (25%) cuts background tokens/s
    assert rate["after"] > 0.9 * rate["before"]  # and it recovers when the zone cools
    itl_before, itl_hot = window_itls(fg, *before), window_itls(fg, *hot)
    assert max(itl_hot) <= max(itl_before) * 1.05  # the foreground is untouched: ITL does not rise
    assert statistics.median(itl_hot) <= statistics.median(itl_before)
    # Held exactly once, released exactly once, at the scripted edges (the governor polls every 0.25 s).
    (t_hold, why), (t_free, none) = governor.transitions
    assert HOT[0] <= t_hold < HOT[0] + 0.5 and "95.0 C > 90.0 C" in why
    assert HOT[1] <= t_free < HOT[1] + 0.5 and none is None
    # Its decisions are in the step trace; off-phase steps carry no background prefill, guarded or not.
    labels = {s.governor.split(":")[0] for s in steps}
    assert labels == {CLEAR, "duty 25% on", "duty 25% off"}
    off = [s for s in steps if s.governor.startswith("duty 25% off")]
    assert off and all(s.n_prefill_bg == 0 for s in off) and any(s.guarded for s in off)


def test_without_a_gate_nothing_changes():
    clock = VirtualClock()
    engine = Engine(SimBackend(clock=clock), PaperDLFP(PARAMS), clock=clock.now).start()
    engine.submit(Request([1, 2, 3], 5, BACKGROUND, ignore_eos=True)).result(timeout=10)
    engine.shutdown()
    assert all(s.governor is None for s in engine.trace.steps)
