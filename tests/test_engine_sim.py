"""The engine loop against the SIMULATED backend (a latency model, not a device)."""
import pytest

from dlfp.sim import SimBackend, SimCost, VirtualClock
from dlfp.paper import PaperDLFP
from dlfp.policy import FixedCap, Unbounded
from dlfp.tail import TailParams
from dlfp.engine import Engine, EngineConfig, InvalidRequest
from dlfp.metrics import itls
from dlfp.sequence import BACKGROUND, FOREGROUND, Request, SamplingParams

PARAMS = TailParams(0.1, 8, 2, 256, 2)


def run(policy, budget=0.5, n_bg=3, multi=True):
    clock = VirtualClock()
    backend = SimBackend(SimCost(), clock=clock, multi_sequence=multi)
    engine = Engine(backend, policy, EngineConfig(preemption_budget_s=budget), clock=clock.now).start()
    handles = [engine.submit(Request(list(range(1, 401)), 4, BACKGROUND, request_id=f"bg{i}")) for i in range(n_bg)]
    handles.append(engine.submit(Request(list(range(3, 40)), 40, FOREGROUND, ignore_eos=True, request_id="fg")))
    records = {h.request_id: h.result(timeout=60) for h in handles}
    engine.shutdown(abort_pending=False)
    return engine, records


def test_outputs_identical_across_policies_and_nothing_lost():
    outs = []
    for policy in (Unbounded(), FixedCap(16), PaperDLFP(PARAMS)):
        engine, records = run(policy, budget=None if isinstance(policy, Unbounded) else 0.5)
        assert all(r.ok for r in records.values())
        assert len(engine.trace.requests) == 4
        assert len(records["fg"].output_ids) == 40
        outs.append({k: r.output_ids for k, r in records.items()})
    assert outs[0] == outs[1] == outs[2]


def test_dlfp_holds_foreground_itl_near_target():
    _, unb = run(Unbounded(), budget=None)
    engine, dl = run(PaperDLFP(PARAMS))
    worst_unbounded = max(itls(unb["fg"]))
    worst_dlfp = max(itls(dl["fg"]))
    assert worst_dlfp < worst_unbounded
    capped = [s for s in engine.trace.steps if s.capped]
    assert capped and all(s.n_prefill_bg + s.n_prefill_fg <= s.cap for s in capped)
    # After the first adjustments, capped steps stay within 1.25x of the target.
    assert all(s.duration_s <= 0.125 for s in capped[3:])


def test_preemption_budget_bounds_isolated_background_steps():
    engine, _ = run(PaperDLFP(PARAMS), budget=0.2)
    alone = [s for s in engine.trace.steps if not s.guarded and s.n_prefill_bg]
    assert alone
    assert max(s.duration_s for s in alone[3:]) <= 0.2 * 1.25


def test_invalid_requests_are_refused_and_recorded():
    clock = VirtualClock()
    engine = Engine(SimBackend(clock=clock, context=64), Unbounded(), clock=clock.now).start()
    bad = [
        Request([1, 2, 3], -1),
        Request([1, 2, 3], 0),
        Request(list(range(100)), 4),  # longer than the context
        Request([1, 5000], 4),  # outside the vocabulary
        Request([], 4),
        Request([1], 4, priority="urgent"),
    ]
    for r in bad:
        with pytest.raises(InvalidRequest):
            engine.submit(r)
    ok = engine.submit(Request([1, 2, 3], 3, ignore_eos=True))
    assert len(ok.result(timeout=10).output_ids) == 3
    engine.shutdown()
    errors = [r for r in engine.trace.requests if r.error]
    assert len(errors) == len(bad)


def test_abort_frees_the_slot():
    clock = VirtualClock()
    backend = SimBackend(clock=clock, max_sequences=1)
    engine = Engine(backend, Unbounded(), clock=clock.now).start()
    long = engine.submit(Request([1, 2, 3], 100000 // 50, ignore_eos=True))
    next(iter(long))
    long.cancel()
    assert long.result(timeout=10).finish_reason == "abort"
    short = engine.submit(Request([4, 5], 2, ignore_eos=True))
    assert short.result(timeout=10).finish_reason == "length"
    engine.shutdown()


def test_eos_stops_unless_ignored():
    clock = VirtualClock()
    backend = SimBackend(clock=clock)
    engine = Engine(backend, Unbounded(), clock=clock.now).start()
    first = engine.submit(Request([7, 8, 9], 30, ignore_eos=True)).result(timeout=10).output_ids
    engine.shutdown()
    backend.eos_id = first[2]
    engine = Engine(backend, Unbounded(), clock=clock.now).start()
    stopped = engine.submit(Request([7, 8, 9], 30)).result(timeout=10)
    engine.shutdown()
    assert stopped.finish_reason == "stop" and stopped.output_ids == first[:3]


def test_time_sliced_backend_completes_everything():
    engine, records = run(PaperDLFP(PARAMS), multi=False)
    assert all(r.ok for r in records.values())
    for s in engine.trace.steps:
        assert s.n_decode + (1 if (s.n_prefill_bg or s.n_prefill_fg) else 0) <= 1


def test_sampling_with_temperature_is_seeded():
    clock = VirtualClock()
    engine = Engine(SimBackend(clock=clock), Unbounded(), clock=clock.now).start()
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    a = engine.submit(Request([1, 2], 5, sampling=sp, ignore_eos=True)).result(timeout=10).output_ids
    b = engine.submit(Request([1, 2], 5, sampling=sp, ignore_eos=True)).result(timeout=10).output_ids
    engine.shutdown()
    assert a == b


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on():
    clock = VirtualClock()
    backend = SimBackend(clock=clock)
    engine = Engine(backend, Unbounded(), clock=clock.now)
    handles = [engine.submit(Request([1, 2, 3], 50, ignore_eos=True)) for _ in range(3)]
    real_step = backend.step

    def broken(plan):
        raise RuntimeError("device lost")

    backend.step = broken
    engine.start()
    records = [h.result(timeout=10) for h in handles]
    assert all(r.finish_reason == "error" and "device lost" in r.error for r in records)
    assert len(engine.trace.requests) == 3
    backend.step = real_step  # the runtime recovered: the engine serves again
    ok = engine.submit(Request([1, 2, 3], 5, ignore_eos=True)).result(timeout=10)
    assert ok.ok and len(ok.output_ids) == 5 and engine.failure is None and engine.running
    engine.shutdown()


def test_an_engine_that_cannot_step_says_so_and_refuses_new_requests():
    from dlfp.engine import MAX_LOOP_FAILURES, EngineStopped

    clock = VirtualClock()
    engine = Engine(SimBackend(clock=clock), Unbounded(), clock=clock.now)
    calls = []

    def broken_plan(*a, **kw):  # a failure no request can be blamed for (not the backend's)
        calls.append(1)
        raise RuntimeError("planner bug")

    engine.scheduler.plan = broken_plan
    handle = engine.submit(Request([1, 2, 3], 5))
    engine.start()
    record = handle.result(timeout=10)
    assert record.finish_reason == "error" and "planner bug" in record.error
    for _ in range(MAX_LOOP_FAILURES):  # each fails alone until the failures in a row reach the limit
        try:
            engine.submit(Request([4, 5], 5)).result(timeout=10)
        except EngineStopped:
            break
    engine._thread.join(timeout=10)
    assert engine.failure and "planner bug" in engine.failure and not engine.running
    assert len(calls) >= MAX_LOOP_FAILURES
    with pytest.raises(EngineStopped, match="planner bug"):
        engine.submit(Request([1, 2, 3], 5))
    assert all(r.error for r in engine.trace.requests)  # every request ended with a recorded error


def test_one_requests_callback_or_seed_cannot_stop_the_engine():
    clock = VirtualClock()
    engine = Engine(SimBackend(clock=clock), Unbounded(), clock=clock.now).start()

    def bad_callback(ev):
        raise KeyError("client went away")

    bad = engine.submit(Request([1, 2, 3], 5, ignore_eos=True), on_event=bad_callback)
    neg = engine.submit(Request([1, 2], 4, sampling=SamplingParams(temperature=0.7, seed=-1), ignore_eos=True))
    good = engine.submit(Request([1, 2, 3], 5, ignore_eos=True))
    assert "callback" in bad.result(timeout=10).error
    assert neg.result(timeout=10).ok and good.result(timeout=10).ok
    assert engine.failure is None and not engine._handles and not engine._seqs  # nothing left behind
    engine.shutdown()


def test_finished_requests_leave_nothing_behind():
    clock = VirtualClock()
    engine = Engine(SimBackend(clock=clock), Unbounded(), clock=clock.now).start()
    events = []
    for i in range(50):
        engine.submit(Request([1, 2, 3], 3, ignore_eos=True), on_event=events.append).result(timeout=10)
    assert not engine._handles and not engine._seqs and not engine._rngs
    assert sum(1 for e in events if e.finish_reason) == 50
    engine.shutdown()


def test_cost_doubling_mid_run_the_tail_cap_follows():
    # SIMULATED: the cost of every step doubles after 150 steps; the tail-aware cap
    # shrinks to what the doubled cost allows and the capped steps return under 1.1 T.
    from dlfp.policy import StepShape
    from dlfp.tail import TailDLFP

    params = TailParams(0.1, 4, 1, 256, 1, max_growth=1.25)
    clock = VirtualClock()
    backend = SimBackend(SimCost(), clock=clock)
    engine = Engine(backend, TailDLFP(params), EngineConfig(preemption_budget_s=0.5), clock=clock.now)

    def shift(rec):
        if len(engine.trace.steps) == 150:
            backend.cost_factor = 2.0

    engine.step_hooks.append(shift)
    # Submitted before the engine starts: submitted after, the background prompts could be
    # prefilled alone before the chat arrived (the thread's timing), leaving no guarded step.
    handles = [engine.submit(Request([1 + k % 997 for k in range(1500)], 4, BACKGROUND, request_id=f"bg{i}")) for i in range(3)]
    handles.append(engine.submit(Request(list(range(3, 40)), 400, FOREGROUND, ignore_eos=True, request_id="fg")))
    engine.start()
    for h in handles:
        assert h.result(timeout=120).ok
    engine.shutdown(abort_pending=False)
    steps = engine.trace.steps
    capped = [(i, s) for i, s in enumerate(steps) if s.guarded and s.n_prefill_bg]
    before = [s.cap for i, s in capped if 100 <= i < 150]
    after = [s for i, s in capped if i >= 165]
    assert before and after
    assert max(s.cap for s in after) < min(before)  # the cap followed the cost down
    assert all(s.duration_s <= 0.110 for s in after)  # and the steps are back under 1.1 T
    assert all(s.duration_s <= 0.110 for i, s in capped if 40 <= i < 150)  # as before the shift


def test_replay_noise_from_a_recorded_trace(tmp_path):
    # SIMULATED backend replaying a step trace: fitted cost and per-step ratios, in order.
    import json

    from dlfp.sim import replay_noise

    rows = []
    for k in range(40):
        n = k % 7
        ratio = 1.5 if k % 10 == 0 else 1.0
        rows.append({"duration_s": (0.010 + 0.002 * n) * ratio, "n_decode": 1, "n_prefill_fg": 0, "n_prefill_bg": n})
    path = tmp_path / "steps-dlfp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    noise = replay_noise(path)
    assert noise.fitted.prefill_token_s == pytest.approx(0.002, rel=0.15)
    assert len(noise.ratios) == 40 and noise.ratios[0] > 1.3 > noise.ratios[1]
    backend = SimBackend(noise=noise)
    from dlfp.protocol import DecodeItem, StepPlan

    plan = StepPlan(decodes=[DecodeItem(0, 1, 5)])
    first, second = backend.time_step(plan), backend.time_step(plan)
    assert first / second == pytest.approx(noise.ratios[0] / noise.ratios[1])
    assert backend.describe()["simulated"] is True


def test_the_policy_is_told_which_decodes_are_foreground():
    # The controller's spread counts a step once per foreground ITL: background decodes in a
    # guarded step are decodes, not the user's ITLs.
    class Recording(FixedCap):
        def __init__(self):
            super().__init__(4)
            self.shapes = []

        def observe(self, latency_s, cap=None, shape=None):
            self.shapes.append(shape)

    policy = Recording()
    clock = VirtualClock()
    engine = Engine(SimBackend(SimCost(), clock=clock), policy, EngineConfig(), clock=clock.now)
    handles = [engine.submit(Request(list(range(1, 9)), 30, BACKGROUND, ignore_eos=True, request_id=f"bg{i}"))
               for i in range(2)]
    handles.append(engine.submit(Request(list(range(3, 40)), 60, FOREGROUND, ignore_eos=True, request_id="fg")))
    engine.start()
    assert all(h.result(timeout=60).ok for h in handles)
    engine.shutdown(abort_pending=False)
    mixed = [s for s in policy.shapes if s.n_decode > s.n_protected]
    assert mixed and all(s.n_protected == 1 and s.itls == 1 for s in mixed)
    assert all(s.n_protected == 1 for s in policy.shapes)  # one chat: every guarded step ends one ITL


def test_a_step_caught_by_a_slowdown_is_cut_and_its_decodes_run_alone():
    # SIMULATED: every step costs four times as much from step 120 on. Under `dlfp` a guarded
    # step with prompt tokens still running at T is cut: its prompt tokens are not counted as
    # run, the next step carries the foreground decode alone (rule "cut", not fed to the
    # policy), and the output is the same as without cutting (cut_at=None).
    from dlfp.tail import TailDLFP

    def go(params):
        clock = VirtualClock()
        backend = SimBackend(SimCost(), clock=clock)
        engine = Engine(backend, TailDLFP(params), EngineConfig(preemption_budget_s=0.5), clock=clock.now)
        engine.step_hooks.append(lambda rec: setattr(backend, "cost_factor", 4.0 if len(engine.trace.steps) >= 120 else 1.0))
        handles = [engine.submit(Request([1 + k % 997 for k in range(800)], 4, BACKGROUND, request_id=f"bg{i}")) for i in range(2)]
        handles.append(engine.submit(Request(list(range(3, 40)), 200, FOREGROUND, ignore_eos=True, request_id="fg")))
        engine.start()
        records = {h.request_id: h.result(timeout=120) for h in handles}
        engine.shutdown(abort_pending=False)
        return engine.trace.steps, records

    params = TailParams(0.1, 4, 1, 256, 1)
    steps, records = go(params)
    plain_steps, plain = go(TailParams(0.1, 4, 1, 256, 1, cut_at=None))
    assert {k: r.output_ids for k, r in records.items()} == {k: r.output_ids for k, r in plain.items()}
    cuts = [i for i, s in enumerate(steps) if s.n_prefill_cut]
    assert cuts and not any(s.n_prefill_cut for s in plain_steps)
    for i in cuts:
        cut, rerun = steps[i], steps[i + 1]
        assert cut.n_prefill_fg == cut.n_prefill_bg == 0 and cut.duration_s == pytest.approx(cut.cut_ms / 1e3)
        assert rerun.rule == "cut" and rerun.n_prefill_fg + rerun.n_prefill_bg == 0 and rerun.observed_s is None
    ran = sum(s.n_prefill_bg for s in steps)
    assert ran == sum(s.n_prefill_bg for s in plain_steps)  # every prompt token counted once
    assert max(itls(records["fg"])) < max(itls(plain["fg"]))


class ThreadedSim(SimBackend):
    """SIMULATED, with a thread count that costs nothing: records what each step ran on."""

    threads = max_threads = 2

    def set_threads(self, n: int) -> bool:
        self.threads = n
        return True

    def step(self, plan):
        self.ran_on = getattr(self, "ran_on", []) + [self.threads]
        return super().step(plan)


@pytest.mark.parametrize("threads", [2, 4])
def test_a_cut_steps_decodes_rerun_on_one_thread_fewer_and_the_threads_come_back(threads):
    # A governed engine (the governor always wants every thread): the rerun after a cut runs on
    # one thread fewer (on two threads: one), the trace row says so, every other step runs on
    # all, and the controller is not told of a device change (the rerun is not observed).
    from dlfp.tail import TailDLFP

    clock = VirtualClock()
    backend = ThreadedSim(SimCost(), clock=clock)
    backend.threads = backend.max_threads = threads
    policy = TailDLFP(TailParams(0.1, 4, 1, 256, 1))
    changes = []
    policy.device_changed = lambda cost_factor=None: changes.append(cost_factor)
    engine = Engine(backend, policy, EngineConfig(preemption_budget_s=0.5), clock=clock.now)
    engine.thread_governor = lambda now: threads
    engine.step_hooks.append(lambda rec: setattr(backend, "cost_factor", 4.0 if len(engine.trace.steps) >= 120 else 1.0))
    handles = [engine.submit(Request([1 + k % 997 for k in range(800)], 4, BACKGROUND, request_id=f"bg{i}")) for i in range(2)]
    handles.append(engine.submit(Request(list(range(3, 40)), 200, FOREGROUND, ignore_eos=True, request_id="fg")))
    engine.start()
    assert all(h.result(timeout=120).ok for h in handles)
    engine.shutdown(abort_pending=False)
    steps = engine.trace.steps
    reruns = [i + 1 for i, s in enumerate(steps) if s.n_prefill_cut]
    assert reruns and all(steps[i].rule == "cut" and steps[i].threads == threads - 1 for i in reruns)
    assert {s.threads for i, s in enumerate(steps) if i not in reruns} == {threads}
    assert backend.ran_on.count(threads - 1) == len(reruns) and backend.threads == threads and not changes


def test_a_new_turn_cuts_the_background_step_it_arrives_behind():
    # SIMULATED, on the wall clock (the sim sleeps): a background step of ~0.4 s (budget 0.5 s)
    # is running when a foreground request arrives. Under a budget the arrival cuts it: the
    # trace has the background step cut (none of its prompt tokens counted as run), the
    # foreground's first token comes well before the step would have ended, and the
    # documents' tokens are all run once. Without a budget (llama.cpp's server) nothing is cut.
    import threading
    import time as wall

    def go(budget):
        backend = SimBackend(SimCost(base_s=0.005, decode_s=0.001, prefill_token_s=0.002), sleep=True)
        engine = Engine(backend, FixedCap(8), EngineConfig(preemption_budget_s=budget, preemption_initial=200)).start()
        bg = engine.submit(Request([1 + k % 997 for k in range(1000)], 2, BACKGROUND, request_id="bg"))
        started = threading.Event()
        engine.step_hooks.append(lambda rec: started.set())
        assert started.wait(10)  # one background step done: the next one is running
        wall.sleep(0.05)
        t0 = wall.perf_counter()
        fg = engine.submit(Request(list(range(3, 20)), 2, FOREGROUND, ignore_eos=True, request_id="fg"))
        first = fg.result(timeout=30)
        waited = first.token_times[0] - first.arrival_s
        bg_record = bg.result(timeout=30)
        engine.shutdown(abort_pending=False)
        assert first.ok and bg_record.ok and wall.perf_counter() - t0 < 30
        return engine.trace.steps, waited

    steps, waited = go(0.5)
    cut = [s for s in steps if not s.guarded and s.n_prefill_cut]
    assert len(cut) == 1 and cut[0].n_prefill_bg == 0 and cut[0].duration_s < 0.3
    assert waited < 0.3  # the step it arrived behind had ~0.35 s left
    assert sum(s.n_prefill_bg for s in steps) == 1000  # the cut chunk ran again, once
    from dlfp.trace import control_counts
    assert control_counts(steps, None)["bg_steps_cut"] == 1
    plain, waited_plain = go(None)
    assert not any(s.n_prefill_cut for s in plain) and waited_plain > waited


@pytest.mark.parametrize("factor", [1.1, 1.0])
def test_a_reply_that_spent_its_excursion_has_its_steps_planned_against_t_over_the_factor(factor):
    # SIMULATED: one step at 4x the cost gives the chat (64 tokens: its own P99 absorbs one ITL
    # over T) its excursion; from then on the steps it streams in are planned against T / 1.1
    # (the decision record's setpoint x margin), and with the factor at 1 against T throughout.
    from dlfp.tail import TailDLFP

    clock = VirtualClock()
    backend = SimBackend(SimCost(), clock=clock)
    params = TailParams(0.1, 4, 1, 256, 1, cut_at=None, spent_factor=factor)
    engine = Engine(backend, TailDLFP(params), EngineConfig(preemption_budget_s=0.5), clock=clock.now)
    engine.step_hooks.append(lambda rec: setattr(backend, "cost_factor", 4.0 if len(engine.trace.steps) == 20 else 1.0))
    handles = [engine.submit(Request([1 + k % 997 for k in range(800)], 4, BACKGROUND, request_id=f"bg{i}")) for i in range(2)]
    handles.append(engine.submit(Request(list(range(3, 40)), 64, FOREGROUND, ignore_eos=True, request_id="fg")))
    engine.start()
    records = {h.request_id: h.result(timeout=120) for h in handles}
    engine.shutdown(abort_pending=False)
    assert max(itls(records["fg"])) > 0.1  # the excursion
    planned = [(i, s.setpoint_ms * s.margin) for i, s in enumerate(engine.trace.steps) if s.guarded and s.setpoint_ms]
    assert [t for i, t in planned if i <= 20] == pytest.approx([100.0] * sum(1 for i, _ in planned if i <= 20))
    after = [t for i, t in planned if i > 21]
    assert after and after == pytest.approx([100.0 / factor] * len(after))
