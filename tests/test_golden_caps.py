"""The controllers choose the recorded caps on every golden scenario (tests/golden_caps.py)."""
import json

import pytest

from golden_caps import GOLDEN, TRACES, closed_loop_scenarios, replay_scenarios

RECORDED = json.loads(GOLDEN.read_text())


def first_difference(got: list, want: list) -> str:
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"step {k}: cap {a}, recorded {b}"
    return f"{len(got)} caps, recorded {len(want)}"


def test_golden_scenarios_exist():
    assert len(TRACES) >= 2, "the committed step traces under docs/traces are the replays' input"
    assert set(RECORDED) == {"closed_loop", "replays"}


@pytest.mark.parametrize("name", sorted(RECORDED["closed_loop"]))
def test_closed_loop_caps_are_the_recorded_ones(name):
    got = closed_loop_scenarios()[name]
    want = RECORDED["closed_loop"][name]
    assert got == want, f"{name}: {first_difference(got, want)}"


def test_replayed_traces_give_the_recorded_caps():
    got = replay_scenarios()
    want = RECORDED["replays"]
    assert set(got) == set(want)
    for name in want:
        for kind in ("caps", "budget_caps"):
            assert got[name][kind] == want[name][kind], f"{name} {kind}: {first_difference(got[name][kind], want[name][kind])}"
