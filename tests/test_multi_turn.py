"""The multi-turn chat workload: its construction from a seed, and a trial on the real
llama.cpp backend where each turn's prompt is built from the reply the previous turn got."""
from dataclasses import replace

import pytest

from dlfp.bench.analysis import output_agreement, trial_row
from dlfp.bench.runner import Arm, run_trial
from dlfp.metrics import SLO
from dlfp.sequence import BACKGROUND, FOREGROUND
from dlfp.workloads.schedule import build_schedule
from dlfp.workloads.specs import RequestClass, SessionClass, WorkloadSpec, get_spec


def test_multi_turn_schedule_is_deterministic_from_its_seed():
    spec = get_spec("multi-turn")
    s = spec.sessions[0]
    assert s.turns >= 8 and spec.has_background
    a, b, c = (build_schedule(spec, seed, 49152) for seed in (801, 801, 802))
    assert a == b and a.fingerprint == b.fingerprint and a.fingerprint != c.fingerprint
    sessions = a.sessions()
    assert len(sessions) == s.count and all(len(t) == s.turns for t in sessions)
    for turns in sessions:
        assert [p.turn for p in turns] == list(range(s.turns))
        assert len(turns[0].prompt_ids) == s.first_len and all(len(p.prompt_ids) == s.message_len for p in turns[1:])
        assert turns[0].think_s == 0 and all(0.5 * s.think_time_s <= p.think_s <= 1.5 * s.think_time_s
                                             for p in turns[1:])
        assert len({p.arrival_s for p in turns}) == 1  # a session arrives once; its turns follow replies
    starts = sorted(t[0].arrival_s for t in sessions)
    assert starts[0] == 0 and starts != sorted(t[0].arrival_s for t in c.sessions())  # open-loop, seeded
    assert len(a.singles()) == spec.classes[0].count and all(p.priority == BACKGROUND for p in a.singles())
    assert s.max_positions == s.first_len + (s.turns - 1) * s.message_len + s.turns * s.output_len <= spec.max_positions
    ingest = get_spec("multi-turn-ingest")
    assert all(p.arrival_s == 0 for p in build_schedule(ingest, 801, 49152).singles())  # a folder dropped at once


def test_scale_and_load_apply_to_sessions():
    spec = get_spec("multi-turn").scaled(0.5).with_load(requests=2, rate=0.1)
    s = spec.sessions[0]
    assert (s.first_len, s.message_len, s.output_len, s.count, s.rate) == (96, 24, 24, 2, pytest.approx(0.1))
    assert spec.classes[0].input_len == 768 and spec.classes[0].count == 2  # background keeps its proportion


TINY = WorkloadSpec(
    "tiny-multi-turn", "",
    (RequestClass("ingest", BACKGROUND, 90, 2, count=2, rate=float("inf")),),
    SLO(), warmup=0,
    sessions=(SessionClass("chat", FOREGROUND, 30, 6, 5, turns=4, count=2, rate=50.0, think_time_s=0.02),),
)


def test_trial_builds_each_turn_from_the_reply_and_reuse_changes_no_token(tiny_gguf):
    pytest.importorskip("llama_cpp")
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from dlfp.protocol import Limits
    from dlfp.bench.target import EngineTarget
    from dlfp.profiles import load_profile

    backend = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(4, 512, 64), n_threads=1))
    try:
        sched = build_schedule(TINY, 5, backend.capabilities.vocab_size)
        target = EngineTarget(backend, load_profile("cpu-laptop"))
        runs = {cache: run_trial(Arm(f"cache={cache}", target, "dlfp"), sched, cache_prompt=cache)
                for cache in (True, False)}
    finally:
        backend.close()
    warm, cold = runs[True], runs[False]
    for run in (warm, cold):
        row = trial_row(run, sched, TINY)
        assert row["reconciled"] and row["completed"] == row["submitted"] == 2 + 2 * 4, row["errors"]
    recs = {r.request_id: r for r in warm.trace.requests}
    for turns in sched.sessions():
        history = []  # the previous turn's prompt and reply
        for p in turns:
            r = recs[p.request_id]
            assert r.prompt_len == len(history) + len(p.prompt_ids)
            if p.turn:
                assert r.cached_prompt_tokens == len(history) - 1  # all but the reply's last token was cached
            history = history + list(p.prompt_ids) + r.output_ids
    agreement = output_agreement([warm, cold], warm.arm)
    assert agreement[cold.arm]["compared"] == 10 and not agreement[cold.arm]["mismatches"]
    row_w, row_c = trial_row(warm, sched, TINY), trial_row(cold, sched, TINY)
    assert row_c["fg_prompt_tokens_reused"] == 0 and row_w["fg_prompt_tokens_reused"] > 0
    assert row_w["fg_prompt_tokens"] == row_c["fg_prompt_tokens"]
    assert len(row_w["ttft_by_turn_ms"]) == 4 and row_w["ttft_turns_6_8_vs_1"] is None  # only 4 turns
    assert row_w["bg_prompt_tok_s_client"] > 0 and row_w["itl_max_ms"] >= row_w["itl_p99_ms"]


def test_a_failed_turn_ends_its_session_with_the_reason():
    import threading
    import time

    from dlfp.trace import RequestRecord, Trace

    class Target:
        label = "t"

        def open(self, policy):
            self.trace = Trace(origin=time.perf_counter())

        def submit(self, request):
            bad = request.request_id.endswith("-t1")
            rec = RequestRecord(request.request_id, request.priority, request.tag, time.perf_counter(),
                                len(request.prompt_ids), [] if bad else [7] * request.max_tokens,
                                [] if bad else [time.perf_counter()] * request.max_tokens,
                                "error" if bad else "length", "boom" if bad else None, time.perf_counter())
            self.trace.add_request(rec)

            class H:
                request_id = request.request_id

                def result(self, timeout=None):
                    return rec

            return H()

        def close(self):
            return self.trace

        def describe(self):
            return {}

    spec = replace(TINY, classes=())
    sched = build_schedule(spec, 1, 1000)
    run = run_trial(Arm("t", Target(), "x"), sched)
    assert set(run.refused) == {f"chat-{i}-t{k}" for i in range(2) for k in (2, 3)}
    assert all("chat-" in why and "failed (boom)" in why for why in run.refused.values())
    row = trial_row(run, sched, spec)
    assert row["reconciled"] and row["failed"] == 6 and row["completed"] == 2
    assert threading.active_count() < 50
