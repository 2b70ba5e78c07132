"""The benchmark harness: accounting, paired gate, traces, and `dlfp bench` end to end."""
import json

import pytest

from dlfp.bench.analysis import _rate, _step_stats, output_agreement, share_rate, trial_row
from dlfp.bench.paired import paired_table, sweep_summary
from dlfp.bench.runner import TrialRun
from dlfp.metrics import SLO
from dlfp.sequence import FOREGROUND
from dlfp.trace import RequestRecord, Trace, read_requests, read_steps, StepRecord
from dlfp.workloads.schedule import build_schedule
from dlfp.workloads.specs import Gate, RequestClass, WorkloadSpec

SPEC = WorkloadSpec("t", "test", (RequestClass("chat", FOREGROUND, 4, 3, count=5, rate=10.0),), SLO(), warmup=0)


def record(rid, n_out, reason="length", error=None, t0=10.0):
    times = [t0 + 0.1 * (i + 1) for i in range(n_out)]
    return RequestRecord(rid, FOREGROUND, "chat", t0, 4, list(range(n_out)), times, reason, error,
                         times[-1] if times else t0)


def test_token_accounting_reconciles_every_request():
    sched = build_schedule(SPEC, 1, 1000)
    ids = [p.request_id for p in sched.measured]
    trace = Trace(origin=0.0)
    trace.add_request(record(ids[0], 3))  # complete
    trace.add_request(record(ids[1], 2))  # short: a failure, not a completion
    trace.add_request(record(ids[2], 1, "error", "boom"))  # engine error
    run = TrialRun(1, "dlfp", 0, trace, refused={ids[3]: "InvalidRequest: too long"})
    row = trial_row(run, sched, SPEC)  # ids[4] never reported: lost
    assert (row["submitted"], row["completed"], row["failed"], row["lost"]) == (5, 1, 3, 1)
    assert row["reconciled"] is False
    assert row["output_tokens"] == row["expected_output_tokens"] == 3
    trace.add_request(record(ids[4], 3))
    row = trial_row(run, sched, SPEC)
    assert row["reconciled"] is True and row["completed"] + row["failed"] == row["submitted"]
    assert row["itl_p99_ms"] == pytest.approx(100.0)


def test_output_agreement_finds_a_changed_token():
    def run(arm, outputs):
        t = Trace(origin=0.0)
        for rid, ids in outputs.items():
            t.add_request(RequestRecord(rid, FOREGROUND, "", 0.0, 1, ids, [1.0] * len(ids), "length", None, 1.0))
        return TrialRun(1, arm, 0, t)

    runs = [run("unbounded", {"a": [1, 2], "b": [3, 4]}), run("dlfp", {"a": [1, 2], "b": [3, 5]})]
    assert output_agreement(runs, "unbounded") == {"dlfp": {"compared": 2, "mismatches": ["b"], "unverifiable": 0}}
    blind = [run("a", {"x": [-1, -1]}), run("b", {"x": [-1, -1]})]  # a server that reports no token ids
    assert output_agreement(blind, "a") == {"b": {"compared": 0, "mismatches": [], "unverifiable": 1}}
    out = paired_table(rows_for([(100, 50)]), ["unbounded", "dlfp"], [0], Gate(),
                       {0: {"dlfp": {"compared": 0, "mismatches": [], "unverifiable": 3}}})
    assert out["candidates"]["dlfp"]["exact_output_agreement"] is False and not out["candidates"]["dlfp"]["gate_pass"]


def rows_for(itl_pairs, fingerprint="f"):
    rows = []
    for seed, (base, cand) in enumerate(itl_pairs):
        for policy, itl in (("unbounded", base), ("dlfp", cand)):
            rows.append({"seed": seed, "policy": policy, "itl_p99_ms": itl, "reconciled": True, "failed": 0,
                         "fingerprint": fingerprint})
    return rows


AGREE = {s: {"dlfp": {"compared": 4, "mismatches": []}} for s in range(3)}


def test_gate_needs_the_reduction_in_every_trial():
    gate = Gate("itl_p99_ms", 0.10)
    ok = paired_table(rows_for([(100, 80), (100, 85), (100, 88)]), ["unbounded", "dlfp"], [0, 1, 2], gate, AGREE)
    c = ok["candidates"]["dlfp"]
    assert c["gate_pass"] and c["exact_output_agreement"]
    assert c["metrics"]["itl_p99_ms"]["change"] == pytest.approx([-0.20, -0.15, -0.12])
    assert c["metrics"]["itl_p99_ms"]["interval"]["df"] == 2
    one_short = paired_table(rows_for([(100, 80), (100, 95), (100, 70)]), ["unbounded", "dlfp"], [0, 1, 2], gate,
                             AGREE)
    assert not one_short["candidates"]["dlfp"]["gate_pass"]


def test_a_token_mismatch_fails_the_trial():
    bad = dict(AGREE)
    bad[1] = {"dlfp": {"compared": 4, "mismatches": ["chat-2"]}}
    out = paired_table(rows_for([(100, 50)] * 3), ["unbounded", "dlfp"], [0, 1, 2], Gate(), bad)
    c = out["candidates"]["dlfp"]
    assert not c["gate_pass"] and c["exact_output_agreement"] is False
    assert [t["pass"] for t in c["trials"]] == [True, False, True]


def test_do_no_harm_gate_judges_the_interval():
    gate = Gate("itl_p99_ms", None)
    harmless = paired_table(rows_for([(100, 101), (100, 98), (100, 100.5)]), ["unbounded", "dlfp"], [0, 1, 2],
                            gate, AGREE)
    assert harmless["candidates"]["dlfp"]["gate_pass"]
    harmful = paired_table(rows_for([(100, 150), (100, 160), (100, 155)]), ["unbounded", "dlfp"], [0, 1, 2],
                           gate, AGREE)
    assert not harmful["candidates"]["dlfp"]["gate_pass"]


def test_sweep_frontier():
    rows = [{"policy": p, "itl_p99_ms": itl, "x": x} for p, itl, x in (
        ("fixed:8", 90, 40), ("fixed:32", 300, 70), ("dlfp", 95, 45), ("unbounded", 1000, 75))]
    s = sweep_summary(rows, ["unbounded", "fixed:8", "fixed:32", "dlfp"], "x", 100.0)
    assert s["dlfp_on_frontier"] and s["best_fixed_meeting_target"] == "fixed:8"
    assert s["dlfp_throughput_ratio_to_best"] == pytest.approx(45 / 40) and s["dlfp_meets_95pct"]
    rows.append({"policy": "fixed:16", "itl_p99_ms": 80, "x": 50})
    s = sweep_summary(rows, ["unbounded", "fixed:8", "fixed:16", "fixed:32", "dlfp"], "x", 100.0)
    assert s["dominated_by"] == ["fixed:16"] and not s["dlfp_on_frontier"]
    assert s["verdict"].startswith("FAIL") and "dominated by fixed:16" in s["verdict"]


def test_sweep_verdict_asks_first_whether_dlfp_met_the_target():
    # The case the old verdict got wrong: DLFP's throughput ratio looked fine, but its P99
    # (123 ms) missed the 100 ms target that fixed:8 (91 ms) met in every trial.
    rows = [{"policy": p, "seed": k, "itl_p99_ms": itl + k, "x": x + k} for k in range(3) for p, itl, x in (
        ("fixed:4", 67, 60), ("fixed:8", 91, 70), ("fixed:16", 160, 80), ("dlfp", 123, 71))]
    s = sweep_summary(rows, ["unbounded", "fixed:4", "fixed:8", "fixed:16", "dlfp"], "x", 100.0)
    assert not s["dlfp_meets_target"]
    assert s["fixed_meeting_target"] == ["fixed:4", "fixed:8"]
    assert s["verdict"].startswith("FAIL: DLFP missed the target")
    assert "fixed:4, fixed:8 met it in every trial and DLFP did not" in s["verdict"]
    p = s["points"]["fixed:8"]
    assert p["trials"] == 3 and p["itl_p99_ms"] == pytest.approx(92)
    assert p["itl_p99_interval"]["low"] < 92 < p["itl_p99_interval"]["high"]
    # One trial over 1.1 T is enough to miss: "met" means in every trial.
    for r in rows:
        if r["policy"] == "dlfp":
            r["itl_p99_ms"] = 100 if r["seed"] else 111
    s = sweep_summary(rows, ["unbounded", "fixed:4", "fixed:8", "fixed:16", "dlfp"], "x", 100.0)
    assert not s["dlfp_meets_target"]
    for r in rows:
        if r["policy"] == "dlfp":
            r["itl_p99_ms"] = 105
    s = sweep_summary(rows, ["unbounded", "fixed:4", "fixed:8", "fixed:16", "dlfp"], "x", 100.0)
    assert s["dlfp_meets_target"] and s["best_fixed_meeting_target"] == "fixed:8"
    assert s["dlfp_throughput_ratio_to_best"] == pytest.approx(72 / 71)
    assert s["verdict"].startswith("PASS")


def test_trace_round_trip(tmp_path):
    t = Trace(origin=100.0)
    rec = RequestRecord("r", FOREGROUND, "chat", 101.0, 4, [5, 6], [101.5, 101.75], "length", None, 101.75, 2)
    t.add_request(rec)
    t.add_step(StepRecord(101.0, 101.5, 0.5, 1, 4, 0, True, 8, None, 0.5))
    paths = t.write(tmp_path, "1-dlfp")
    (back,) = read_requests(paths["requests"])
    assert back.output_ids == [5, 6] and back.token_times == pytest.approx([1.5, 1.75])
    assert back.arrival_s == pytest.approx(1.0) and back.n_prefill_chunks == 2 and back.tag == "chat"
    (step,) = read_steps(paths["steps"])
    assert (step.t0, step.t1, step.cap, step.n_prefill_fg) == pytest.approx((1.0, 1.5, 8, 4))


# -- end to end on a tiny generated GGUF ---------------------------------------
pytest.importorskip("llama_cpp")


def test_dlfp_bench_end_to_end_writes_every_file(tiny_gguf, tmp_path):
    from click.testing import CliRunner

    from dlfp.cli import main

    out = tmp_path / "run"
    args = ["bench", "--model", str(tiny_gguf), "--workload", "laptop", "--scale", "0.1", "--requests", "3",
            "--rate", "20", "--warmup", "1", "--threads", "1", "--probe-period-s", "0", "--sweep", "fixed:8",
            "--out", str(out), "--seeds", "5", "6"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert {(r["seed"], r["policy"]) for r in rows} == {(s, p) for s in (5, 6) for p in ("unbounded", "fixed:8", "dlfp")}
    assert [r["policy"] for r in rows if r["seed"] == 6] == ["dlfp", "fixed:8", "unbounded"]  # alternated
    assert all(r["reconciled"] and r["failed"] == 0 and r["output_tokens"] == r["expected_output_tokens"]
               for r in rows)
    for seed in (5, 6):
        for label in ("unbounded", "fixed-8", "dlfp"):
            assert (out / f"requests-{seed}-{label}.jsonl").exists() and (out / f"steps-{seed}-{label}.jsonl").exists()
    paired = json.loads((out / "paired.json").read_text())
    assert paired["paired"]["candidates"]["dlfp"]["exact_output_agreement"] is True
    assert paired["sweep"]["x_metric"] == "bg_prefill_tok_s_fg_active"
    config = json.loads((out / "config.json").read_text())
    assert config["args"]["seeds"] == [5, 6] and list(config["models"].values())[0]["sha256"]
    assert config["prompt_source"] == "text"
    assert "dlfp vs unbounded" in result.output

    report = CliRunner().invoke(main, ["report", str(out), "--no-table"], catch_exceptions=False)
    assert report.exit_code == 0, report.output
    for png in ("itl_cdf.png", "ttft_vs_p99_itl.png", "dlfp_cap_timeline.png", "sweep.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    again = tmp_path / "again"
    rerun = CliRunner().invoke(main, ["bench", "--from", str(out / "config.json"), "--out", str(again)],
                               catch_exceptions=False)
    assert rerun.exit_code == 0, rerun.output
    rows2 = [json.loads(line) for line in (again / "trials.jsonl").read_text().splitlines()]
    assert [r["fingerprint"] for r in rows2] == [r["fingerprint"] for r in rows]
    first = read_requests(out / "requests-5-dlfp.jsonl")
    second = {r.request_id: r.output_ids for r in read_requests(again / "requests-5-dlfp.jsonl")}
    assert all(second[r.request_id] == r.output_ids for r in first)


def test_bad_inputs_give_one_line(tiny_gguf, tmp_path):
    from click.testing import CliRunner

    from dlfp.cli import main

    base = ["bench", "--model", str(tiny_gguf), "--threads", "1", "--out", str(tmp_path)]
    for extra, needle in ((["--workload", "nope"], "unknown workload"),
                          (["--workload", "agent"], "--scale"),
                          (["--policies", "unbounded,bogus"], "unknown policy"),
                          (["--endpoint", "novalue"], "LABEL=URL")):
        r = CliRunner().invoke(main, base + extra)
        assert r.exit_code != 0 and needle in r.output and "Traceback" not in r.output


def test_overhead_against_llama_cpp_python(tiny_gguf):
    from dlfp.protocol import Limits
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from dlfp.bench.overhead import measure_overhead
    from dlfp.profiles import load_profile

    backend = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(4, 512, 128), n_threads=1))
    try:
        out = measure_overhead(backend, load_profile("cpu-laptop"), prompt_len=24, n_tokens=16, repeats=1)
    finally:
        backend.close()
    d, c = out["decode"], out["control"]
    assert d["engine_median_tok_s"] > 0 and d["llama_cpp_python_median_tok_s"] > 0 and d["ratio"] > 0
    assert d["same_tokens"]  # both loops greedy on the same model: identical ids
    assert c["capped_steps"] > 0 and 0 < c["share_of_step_mean"] < 1


def test_arrivals_are_open_loop_and_warmups_closed_loop():
    """Submissions follow the schedule even while earlier requests are still running."""
    import threading
    import time

    from dlfp.bench.runner import Arm, run_trial

    class SlowTarget:
        label = "slow"

        def open(self, policy):
            self.trace, self.submits = Trace(origin=time.perf_counter()), []

        def submit(self, request):
            now = time.perf_counter()
            self.submits.append((request.request_id, now))
            done = threading.Event()
            rec = record(request.request_id, request.max_tokens, t0=now)

            def finish():
                time.sleep(0.3)  # every request takes far longer than the gap between arrivals
                self.trace.add_request(rec)
                done.set()

            threading.Thread(target=finish, daemon=True).start()

            class Handle:
                request_id = request.request_id

                def result(self, timeout=None):
                    done.wait(timeout)
                    return rec

            return Handle()

        def close(self):
            return self.trace

        def describe(self):
            return {}

    spec = WorkloadSpec("t", "", (RequestClass("chat", FOREGROUND, 4, 3, count=4, rate=20.0),), SLO(), warmup=1)
    sched = build_schedule(spec, 3, 1000)
    target = SlowTarget()
    run = run_trial(Arm("x", target, "x"), sched)
    t_warm = dict(target.submits)["warmup-0"]
    measured = [(rid, t) for rid, t in target.submits if rid != "warmup-0"]
    assert measured[0][1] - t_warm >= 0.3  # the warmup finished before the measured run began
    start = measured[0][1]
    for (rid, t), planned in zip(measured, sched.measured):
        assert rid == planned.request_id
        assert abs((t - start) - planned.arrival_s) < 0.1  # on schedule, not after the previous completion
    assert run.max_submit_lag_s < 0.1
    assert trial_row(run, sched, spec)["reconciled"]


# -- the noisy-neighbour workload ------------------------------------------------
def test_noisy_neighbour_runs_in_the_middle_third_of_the_arrivals():
    from dlfp.workloads.specs import get_spec

    spec = get_spec("noisy-neighbour")
    assert spec.neighbour and {c.input_len for c in spec.classes if c.priority != FOREGROUND} == {256, 1792}
    sched = build_schedule(spec, 801, 1000)
    span = sched.measured[-1].arrival_s
    assert sched.neighbour_s == pytest.approx((span / 3, 2 * span / 3))
    assert build_schedule(get_spec("laptop"), 801, 1000).neighbour_s is None


def test_neighbour_child_process_starts_and_stops():
    import psutil

    from dlfp.bench.neighbour import Neighbour

    n = Neighbour()
    n.start()
    try:
        assert psutil.Process(n.proc.pid).is_running() and n.started_s is not None
    finally:
        n.stop()
    assert n.proc.returncode is not None and n.stopped_s >= n.started_s
    n.stop()  # idempotent


def test_the_neighbour_ends_with_a_bench_killed_before_it_could_stop_it():
    import subprocess
    import sys
    import time

    import psutil

    start = "from dlfp.bench.neighbour import Neighbour; import time; n = Neighbour(); n.start(); " \
            "print(n.proc.pid, flush=True); time.sleep(60)"

    def spinning(proc: psutil.Process) -> bool:
        try:
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    bench = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE, text=True)
    spinner = psutil.Process(int(bench.stdout.readline()))
    try:
        assert spinning(spinner)
        bench.kill()  # no `stop()` runs: SIGKILL, as a SIGTERM with no handler would
        bench.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and spinning(spinner):
            time.sleep(0.05)
        left = spinning(spinner)
    finally:
        if spinning(spinner):
            spinner.kill()
    assert not left


def test_trial_row_splits_phases_around_the_neighbour():
    sched = build_schedule(SPEC, 1, 1000)
    ids = [p.request_id for p in sched.measured]
    trace = Trace(origin=0.0)
    # Five requests, one after another from t=10: the gaps are 100 ms, except 400 ms in the middle.
    for k, rid in enumerate(ids):
        t0 = 10.0 + k
        gap = 0.4 if k == 2 else 0.1
        times = [t0 + gap * (i + 1) for i in range(3)]
        trace.add_request(RequestRecord(rid, FOREGROUND, "chat", t0, 4, [1, 2, 3], times, "length", None, times[-1]))
    trace.add_step(StepRecord(12.0, 12.4, 0.4, 1, 0, 0, True, 0, None, 0.4))
    run = TrialRun(1, "dlfp", 0, trace, neighbour=(11.9, 13.5))
    row = trial_row(run, sched, SPEC)
    before, busy, after = (row["phases"][k] for k in ("before", "neighbour", "after"))
    assert busy["itl_p99_ms"] == pytest.approx(400.0) and busy["itl_max_ms"] == pytest.approx(400.0)
    assert before["itl_max_ms"] == pytest.approx(100.0) and after["itl_max_ms"] == pytest.approx(100.0)
    assert row["neighbour_s"] == pytest.approx([11.9, 13.5])
    assert row["itl_max_ms"] == pytest.approx(400.0) and row["zero_cap_steps"] == 1


def test_the_worst_phase_skips_a_phase_without_foreground_itls():
    # A trial whose chats all ended before the neighbour started has phases with no ITLs: the
    # worst phase P99 is the others', in the console table and in the docs' tables alike.
    import io

    from rich.console import Console

    from dlfp.bench.paired import worst_phase_p99
    from dlfp.bench.table import phases_table

    phase = lambda p99: {"itl_p99_ms": p99, "itl_max_ms": p99, "bg_prefill_tok_s_fg_active": 1.0}
    rows = [{"seed": 1, "policy": "dlfp", "itl_p99_ms": 90.0,
             "phases": {"before": phase(97.9), "neighbour": phase(None), "after": phase(None)}},
            {"seed": 2, "policy": "dlfp", "itl_p99_ms": 95.0,
             "phases": {"before": phase(80.0), "neighbour": phase(104.6), "after": phase(70.0)}}]
    assert [worst_phase_p99(r) for r in rows] == [97.9, 104.6]
    out = io.StringIO()
    phases_table(rows, Console(file=out, width=200), target_ms=100)
    assert "worst P99 ITL in any trial and phase 104.6 ms (<= 1.1 T = 110 ms)" in out.getvalue()


def test_a_bounded_trace_says_up_to_when_it_dropped_steps():
    trace = Trace(origin=0.0)
    for i in range(10):
        trace.add_step(StepRecord(i, i + 0.5, 0.5, 1, 0, 0, True, 4, None))
    trace.drop_oldest(keep_steps=5, keep_others=5)
    assert trace.steps_dropped_until is None and len(trace.steps) == 10  # within twice the bound: kept
    trace.add_step(StepRecord(10, 10.5, 0.5, 1, 0, 0, True, 4, None))
    trace.drop_oldest(keep_steps=5, keep_others=5)
    assert [s.t0 for s in trace.steps] == [6, 7, 8, 9, 10] and trace.steps_dropped_until == 5.5
    assert [s.t0 for s in trace.steps_since(8)] == [8, 9, 10]


def test_share_rate_counts_a_step_by_its_time_inside_the_windows():
    # A 0.5 s background step in flight when the chat arrives at 10.3 (0.1 s of it inside the
    # window), then one wholly inside: counted at the end the first counts whole.
    steps = [StepRecord(9.9, 10.3 + 0.1, 0.5, 0, 0, 40, False, None, 40),
             StepRecord(10.5, 10.6, 0.1, 1, 0, 10, True, 10, None)]
    windows = [(10.3, 11.3)]
    assert _rate(steps, ("n_prefill_bg",), windows) == pytest.approx(50.0)
    assert share_rate(steps, windows) == pytest.approx(40 * 0.1 / 0.5 + 10)
    assert share_rate(steps, []) is None


def test_step_gap_is_the_engine_time_between_busy_steps():
    # 1 ms and 3 ms between steps; the 2 s pause (nothing to run) is idle, not counted.
    steps = [StepRecord(t0, t0 + 0.01, 0.01, 1, 0, 0, True, 4, None) for t0 in (0.0, 0.011, 0.024, 2.0)]
    assert _step_stats(steps, None)["step_gap_ms_mean"] == pytest.approx(2.0)
    assert _step_stats([], None)["step_gap_ms_mean"] is None
