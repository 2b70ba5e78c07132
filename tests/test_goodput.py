"""Per-request goals: carried by a request, planned for by the scheduler and the controller,
and judged per request by the bench (goodput), with its change in points."""
import json
from dataclasses import replace

import pytest

from dlfp.bench.analysis import trial_row
from dlfp.bench.doc_tables import _fg_submitted, _missed
from dlfp.bench.paired import background_metric, goodput_summary, paired_table
from dlfp.bench.runner import TrialRun
from dlfp.metrics import SLO, goals_met, missed_goals
from dlfp.observer import StepObserver
from dlfp.protocol import TIMING_SYNC_WALL, Capabilities
from dlfp.scheduler import Scheduler
from dlfp.sequence import BACKGROUND, FOREGROUND, Request, Sequence, Status
from dlfp.server.completions import resolve_goals
from dlfp.server.errors import APIError
from dlfp.server.schemas import CompletionRequest, parse
from dlfp.stats import paired_differences
from dlfp.tail import TailDLFP, TailParams
from dlfp.trace import RequestRecord, Trace
from dlfp.workloads.schedule import build_schedule
from dlfp.workloads.specs import Gate, Goals, RequestClass, WorkloadSpec, get_spec


def test_a_request_carries_its_own_goals_and_background_has_none():
    Request([1, 2], 4, FOREGROUND, itl_target_s=0.05, ttft_goal_s=2.0).validate(100, 64)
    for bad in (dict(itl_target_s=0.0), dict(ttft_goal_s=-1.0), dict(itl_target_s=float("nan")),
                dict(ttft_goal_s=True)):
        with pytest.raises(ValueError, match="positive number of seconds"):
            Request([1, 2], 4, FOREGROUND, **bad).validate(100, 64)
    with pytest.raises(ValueError, match="background request has none"):
        Request([1, 2], 4, BACKGROUND, itl_target_s=0.05).validate(100, 64)


def body(**fields) -> CompletionRequest:
    return parse(CompletionRequest, json.dumps({"prompt": [1, 2], **fields}).encode())


def test_goals_come_from_the_body_or_the_headers_in_milliseconds():
    assert resolve_goals(body(itl_target_ms=50, ttft_goal_ms=2000), {}, FOREGROUND) == (0.05, 2.0)
    assert resolve_goals(body(), {"x-itl-target-ms": "150"}, FOREGROUND) == (0.15, None)
    assert resolve_goals(body(itl_target_ms=50), {"x-itl-target-ms": "150"}, FOREGROUND) == (0.05, None)  # body wins
    assert resolve_goals(body(), {}, FOREGROUND) == (None, None)
    for headers in ({"x-itl-target-ms": "fast"}, {"x-ttft-goal-ms": "-3"}, {"x-ttft-goal-ms": "inf"}):
        with pytest.raises(APIError) as exc:
            resolve_goals(body(), headers, FOREGROUND)
        assert exc.value.status == 400 and "milliseconds" in exc.value.message
    with pytest.raises(APIError) as exc:
        resolve_goals(body(ttft_goal_ms=100), {}, BACKGROUND)
    assert exc.value.param == "ttft_goal_ms"
    with pytest.raises(APIError):  # the schema: a goal is a positive number
        body(itl_target_ms=0)


def caps():
    return Capabilities(True, True, True, TIMING_SYNC_WALL, 4, 1024, 64, 100)


def streaming(priority=FOREGROUND, **goals) -> Sequence:
    s = Sequence(Request(list(range(1, 11)), 8, priority, **goals), arrival_s=0.0)
    s.n_prefilled, s.output_ids = 10, [5]
    return s


def test_the_controller_holds_the_tightest_target_among_the_streaming_chats():
    sched = Scheduler(caps())
    seqs = [streaming(itl_target_s=0.15), streaming(itl_target_s=0.05), streaming(), streaming(BACKGROUND)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    for s in seqs:
        s.status = Status.DECODING
    assert sched.itl_target_s() == 0.05
    seqs[1].status = Status.FINISHED
    sched.running.remove(seqs[1])
    assert sched.itl_target_s() == 0.15  # the fast chat ended: the slow one's target is the tightest named


def test_a_reply_that_spent_its_excursion_is_planned_against_a_tighter_target():
    # A 64-token reply's own P99 (63 ITLs) lies between its two largest ITLs: it absorbs one
    # ITL over its target; a 200-token reply two; a 2-token reply (one ITL) none.
    assert [Sequence(Request([1], n), 0.0).excursions_absorbed() for n in (2, 64, 200)] == [0, 1, 2]
    sched = Scheduler(caps())
    chat, named = streaming(), streaming(itl_target_s=0.2)
    for s in (chat, named):
        s.request.max_tokens = 64
        sched.add(s)
    sched.admit()
    for s in (chat, named):
        s.status = Status.DECODING
    chat.token_times, named.token_times = [0.0, 0.09, 0.18], [0.0, 0.15, 0.5]
    assert sched.itl_target_s() == 0.2  # no factor: the requests' own targets as named
    assert sched.itl_target_s(0.1, 1.1) == 0.1  # the chat's ITLs within its default target
    chat.token_times.append(0.3)  # one ITL over 0.1: the one its P99 absorbs is spent
    assert sched.itl_target_s(0.1, 1.1) == 0.1 / 1.1
    chat.status = Status.FINISHED
    sched.running.remove(chat)
    assert sched.itl_target_s(0.1, 1.1) == 0.2 / 1.1  # 0.35 s over its own 0.2


def test_foreground_prompts_load_earliest_deadline_first():
    sched = Scheduler(caps(), ttft_goal_s=5.0)
    late = Sequence(Request(list(range(1, 31)), 4, FOREGROUND), arrival_s=0.0)  # deadline 5.0
    urgent = Sequence(Request(list(range(1, 31)), 4, FOREGROUND, ttft_goal_s=1.0), arrival_s=2.0)  # 3.0
    doc = Sequence(Request(list(range(1, 31)), 4, BACKGROUND), arrival_s=0.0)
    for s in (doc, late, urgent):
        sched.add(s)
    sched.admit()
    step = sched.plan(cap=None, bg_cap=None)
    assert [c.seq_id for c in step.plan.prefills][:2] == [urgent.slot, late.slot]


def test_the_tail_controller_plans_for_the_target_it_is_given():
    c = TailDLFP(TailParams(0.100, 4, 1, 256, 1, zero_cap=True))
    c.model.base_ms, c.model.seq_ms, c.model.token_ms, c.model.n_obs = 20.0, 10.0, 5.0, 100
    own, fast = c.decide(1), c.decide(1, target_s=0.050)
    assert (own.cap, fast.cap) == (8, 1)  # 20 + 10 + 5 (n - 1) within 66.7 ms, and within 33.3 ms
    assert fast.setpoint_ms == pytest.approx(50 / 1.5)
    assert c.decide(1, target_s=0.030).rule == "hold"


def test_a_new_turn_that_cannot_fit_beside_the_streams_waits_and_the_record_says_so():
    c = TailDLFP(TailParams(0.100, 4, 1, 256, 1, zero_cap=True))
    c.model.base_ms, c.model.seq_ms, c.model.token_ms, c.model.n_obs = 60.0, 10.0, 5.0, 100
    obs = StepObserver(c, clock=lambda: 0.0)
    assert obs.begin(True, 1, None, turn_loading=False) == 0 and obs.decision.rule == "hold"
    assert obs.begin(True, 1, None, turn_loading=True) == 0 and obs.decision.rule == "wait"


def record(ttft_s: float, gaps: list[float], error: str | None = None) -> RequestRecord:
    times = [ttft_s]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord("r", FOREGROUND, "chat", 0.0, 10, [1] * len(times), times, "length", error, times[-1])


def test_a_request_meets_its_goals_by_its_ttft_and_its_own_p99_itl():
    steady = [0.05] * 63
    assert goals_met(record(1.0, steady), 5.0, 0.05)
    assert not goals_met(record(6.0, steady), 5.0, 0.05)  # late first token
    assert not goals_met(record(1.0, steady[:-1] + [0.2]), 5.0, 0.05)  # one stall in 63 ITLs is past its P99
    assert goals_met(record(1.0, steady[:-1] + [0.2]), 5.0, 0.15)  # within a slower chat's own target
    assert not goals_met(record(1.0, steady, error="boom"), 5.0, 0.05)


def test_a_missed_request_says_which_goal_it_missed():
    steady = [0.05] * 63
    assert missed_goals(record(1.0, steady), 5.0, 0.05) == []
    assert missed_goals(record(6.0, steady[:-1] + [0.2]), 5.0, 0.05) == ["ttft", "itl"]
    assert missed_goals(record(6.0, steady), None, 0.05) == []  # a goal of None is not judged
    assert missed_goals(record(1.0, steady, error="boom"), 5.0, 0.05) == ["failed"]


def test_a_trial_counts_the_goals_its_requests_missed_and_an_arm_sums_them():
    spec = WorkloadSpec("t", "test", (RequestClass("chat", FOREGROUND, 4, 3, count=5, rate=10.0),),
                        SLO(ttft_s=1.0), warmup=0)
    sched = build_schedule(spec, 1, 1000)
    ids = [p.request_id for p in sched.measured]
    trace = Trace(origin=0.0)

    def add(rid, ttft_s, gaps, error=None):
        times = [10.0 + ttft_s]
        for g in gaps:
            times.append(times[-1] + g)
        times = [] if error else times
        trace.add_request(RequestRecord(rid, FOREGROUND, "chat", 10.0, 4, [1] * len(times), times,
                                        "error" if error else "length", error, times[-1] if times else 10.0))

    add(ids[0], 0.5, [0.05, 0.05])  # met
    add(ids[1], 2.0, [0.05, 0.05])  # late first token
    add(ids[2], 0.5, [0.05, 0.3])  # a stall: its own P99 over 1.1 x 50 ms
    add(ids[3], 0.0, [], error="boom")  # failed; ids[4] never reported: failed too
    row = trial_row(TrialRun(1, "dlfp", 0, trace), sched, spec, itl_target_ms=50.0)
    assert row["goals_met"] == 1 and row["goals_missed"] == {"ttft": 1, "itl": 1, "failed": 2}
    rows = [dict(row, seed=s, policy="dlfp", bg_prompt_tok_s_client=1.0) for s in (1, 2)]
    g = goodput_summary(rows, ["dlfp"], "bg_prompt_tok_s_client")
    assert "verdict" not in g  # one arm alone is on no frontier against another
    arm = g["arms"]["dlfp"]
    assert arm["missed"] == {"ttft": 2, "itl": 2, "failed": 4}
    assert _missed(arm) == "; goals missed: TTFT 2, ITL 2, failed 4"
    old = [{k: v for k, v in r.items() if k != "goals_missed"} for r in rows]  # rows from before the count
    assert "missed" not in goodput_summary(old, ["dlfp"], "bg_prompt_tok_s_client")["arms"]["dlfp"]


def test_a_trial_that_met_no_goal_still_says_of_how_many():
    row = {"goals_met": 0, "goodput": 0.0, "fg_completed": 10, "goals_missed": {"ttft": 7, "itl": 10, "failed": 2}}
    assert _fg_submitted(row) == 12  # completed and failed: every submitted foreground request
    assert _fg_submitted({"goals_met": 3, "goodput": 0.25}) == 12  # a row from before the count
    assert _fg_submitted({"goals_met": 0, "goodput": 0.0}) is None  # nothing to say it by


def test_goodput_changes_are_differences_in_points():
    assert paired_differences([0.0, 0.5, None], [0.25, 0.25, 1.0]) == [0.25, -0.25, None]
    rows = [{"seed": s, "policy": p, "goodput": g, "goodput_fraction": g, "reconciled": True, "failed": 0,
             "fingerprint": "x", "itl_p99_ms": 1.0}
            for s, p, g in [(1, "unbounded", 0.0), (1, "dlfp", 0.5), (2, "unbounded", 0.25), (2, "dlfp", 0.5)]]
    table = paired_table(rows, ["unbounded", "dlfp"], [1, 2], Gate(), {})
    assert table["candidates"]["dlfp"]["metrics"]["goodput"]["change"] == [0.5, 0.25]  # not +inf% and +100%


def test_the_goodput_frontier_is_no_arm_better_on_both_goodput_and_background():
    rows = [{"seed": 1, "policy": p, "goodput": g, "bg_prompt_tok_s_client": x}
            for p, g, x in [("unbounded", 0.5, 30.0), ("fixed:2", 0.5, 10.0), ("dlfp", 0.75, 20.0)]]
    rows += [{"seed": 2, "policy": p, "goodput": g, "bg_prompt_tok_s_client": x}
             for p, g, x in [("unbounded", 0.25, 30.0), ("fixed:2", 1.0, 25.0), ("dlfp", 0.75, 20.0)]]
    g = goodput_summary(rows, ["unbounded", "fixed:2", "dlfp"], "bg_prompt_tok_s_client")
    assert g["trials"]["1"]["frontier"] == ["unbounded", "dlfp"]  # fixed:2 is beaten by dlfp on background
    assert g["trials"]["2"]["frontier"] == ["unbounded", "fixed:2"]  # dlfp beaten on both by fixed:2
    assert (g["arms"]["dlfp"]["on_frontier"], g["arms"]["dlfp"]["highest"]) == (1, 1)
    assert g["verdict"] == "dlfp on the goodput frontier in 1 of 2 trials; goodput at least every other arm's in 1 of 2"


def test_the_frontier_weighs_background_loaded_while_a_chat_streams_where_every_arm_reports_it():
    # Every arm's documents finished within the trial: the client's rate ties them to a
    # rounding, and the frontier would be goodput alone (runs/2026-12-05-law-mixed-goals
    # seed 802: fixed:2 24.9 tok/s while a chat streamed, dlfp 65.9; 72.5 and 72.4 client side).
    rows = [{"seed": 1, "policy": p, "goodput": g, "bg_prompt_tok_s_client": c, "bg_prefill_tok_s_fg_active": x}
            for p, g, c, x in [("fixed:2", 1.0, 72.5, 24.9), ("dlfp", 0.9, 72.4, 65.9)]]
    assert goodput_summary(rows, ["fixed:2", "dlfp"], "bg_prompt_tok_s_client")["trials"]["1"]["frontier"] == ["fixed:2"]
    assert background_metric(rows) == "bg_prefill_tok_s_fg_active"
    g = goodput_summary(rows, ["fixed:2", "dlfp"], background_metric(rows))
    assert g["trials"]["1"]["frontier"] == ["fixed:2", "dlfp"]
    rows.append({"seed": 1, "policy": "llama-server", "goodput": 0.5, "bg_prompt_tok_s_client": 90.0,
                 "bg_prefill_tok_s_fg_active": None})  # an endpoint: no step trace
    assert background_metric(rows) == "bg_prompt_tok_s_client"


def test_the_mixed_goal_workload_sends_each_request_its_own_goals():
    spec = get_spec("mixed-goals")
    schedule = build_schedule(spec, 801, 1000)
    fast = [p for p in schedule.measured if p.tag == "chat-fast"]
    slow = [p for p in schedule.measured if p.tag == "chat-slow"]
    assert fast and slow and all(p.priority == FOREGROUND for p in fast + slow)
    assert {p.to_request().itl_target_s for p in fast} == {0.05} and {p.to_request().itl_target_s for p in slow} == {0.15}
    assert {p.to_request().ttft_goal_s for p in fast + slow} == {5.0}
    assert all(p.goals is None and p.to_request().itl_target_s is None for p in schedule.measured if p.tag == "ingest")
    # Goals are part of what a plan is: the same plan with other goals has another fingerprint.
    looser = replace(spec, classes=tuple(replace(c, goals=Goals(60.0, 5.0)) if c.goals else c for c in spec.classes))
    assert build_schedule(looser, 801, 1000).fingerprint != schedule.fingerprint
    assert build_schedule(spec, 801, 1000).fingerprint == schedule.fingerprint
