"""The thread governor: unit checks on scripted loads, the CPU probe's `other_cores` on the
running system, llama.cpp's thread switch on the tiny GGUF, and the engine driven on the
SIMULATED backend (a latency model on a virtual clock, not a device) where a scripted
neighbour takes a core mid-run."""
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from dlfp.sim import SimBackend, SimCost, VirtualClock
from dlfp.tail import TailDLFP, TailParams
from dlfp.devices.cpu import CpuProbe, LoadWatch, OtherLoad
from dlfp.devices.threads import ThreadGovernor
from dlfp.engine import Engine, EngineConfig
from dlfp.sequence import BACKGROUND, FOREGROUND, Request


def load(cores):
    return cores


def test_wanted_threads_leave_the_neighbours_cores():
    g = ThreadGovernor(lambda: [], max_threads=4, slack=0.4)
    assert [g.wanted(x) for x in (0.0, 0.39, 0.5, 1.0, 1.4, 1.5, 3.9, 8.0)] == [4, 4, 3, 3, 3, 2, 1, 1]
    assert ThreadGovernor(lambda: [], max_threads=2, min_threads=2).wanted(5.0) == 2


def test_lowers_after_the_hold_and_raises_one_at_a_time():
    series = iter([load(2.0)] * 4 + [load(0.0)] * 20)
    g = ThreadGovernor(lambda: next(series), max_threads=4, lower_after_s=0.5, raise_after_s=1.0, poll_s=0.0)
    assert g(0.0) == 4 and g(0.3) == 4  # the wish (2) has not held long enough
    assert g(0.6) == 2 and g(0.9) == 2
    assert g(1.0) == 2  # the load is gone: the wish is 4 from here
    assert g(1.5) == 2 and g(2.0) == 3  # one thread after raise_after_s ...
    assert g(2.5) == 3 and g(3.0) == 4  # ... and the next one after another
    assert [(t, n) for t, n, _ in g.transitions] == [(0.6, 2), (2.0, 3), (3.0, 4)]


def test_a_short_burst_does_not_switch():
    series = iter([load(0.0), load(1.5), load(1.5), load(0.0), load(0.0)])
    g = ThreadGovernor(lambda: next(series), max_threads=2, lower_after_s=0.75, poll_s=0.0)
    assert [g(t) for t in (0.0, 0.25, 0.5, 0.75, 1.0)] == [2, 2, 2, 2, 2]
    assert g.transitions == []


def test_no_figure_changes_nothing():
    series = iter([None, 1.0, None, None, None, 0.0])
    g = ThreadGovernor(lambda: next(series), max_threads=2, raise_after_s=1.0, poll_s=0.0)
    assert g(0.0) == 2 and g.others is None  # nothing read yet: all threads
    assert g(0.5) == 1  # lowered at once
    assert [g(t) for t in (1.0, 2.0, 3.0)] == [1, 1, 1]  # no new figure is no reason to raise
    assert g(3.5) == 1 and g.others == 0.0  # the wish to raise starts only now


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ThreadGovernor(lambda: [], max_threads=2, min_threads=3)
    with pytest.raises(ValueError):
        ThreadGovernor(lambda: [], max_threads=2, slack=-1)


def test_other_load_counts_a_spinning_child():
    """Real: the running system's /proc/stat through psutil, with a child spinning on a core."""
    probe = OtherLoad()
    time.sleep(0.2)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        probe.read()  # start the window once the child runs
        time.sleep(1.0)
        others = probe.read()
    finally:
        spin.kill()
        spin.wait()
    assert others is not None and others >= 0.6  # the child is not this process: it counts
    values = CpuProbe().read()[0].values
    assert "util_pct" in values  # the first read of a fresh probe may come too soon for other_cores


def test_load_watch_sees_a_neighbour_that_started_late_in_a_long_step():
    """Real /proc/stat: a caller blocked for 2.1 s (a long step) while a child started spinning
    1.6 s into it. Read once across the whole step the child is diluted to a quarter of a core,
    below the governor's slack (0.4); the watch's figure covers its last period only."""
    watch = LoadWatch(period_s=0.2).start()
    across_the_step = OtherLoad()
    spin = None
    try:
        time.sleep(1.6)  # the step runs; no neighbour yet
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)  # ... and ends with the neighbour spinning for its last part
        others, diluted = watch.read(), across_the_step.read()
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
        watch.stop()
    assert others is not None and others >= 0.6
    assert diluted is not None and diluted < others - 0.3  # what a read between steps saw
    assert ThreadGovernor(watch.read, max_threads=2, poll_s=0.0)(0.0) == 1
    with pytest.raises(ValueError):
        LoadWatch(period_s=0.01)


def test_load_watch_reads_up_to_the_moment_it_is_asked():
    """A neighbour that started 0.12 s before the governor asks is in the figure, though the
    watch's thread last ran before it started: a figure kept from a timer's last read would end
    there (in the noisy-neighbour workload the step it slowed was followed by one of 260-320 ms
    on two threads). A read before a period of snapshots exists gives none."""
    watch = LoadWatch(period_s=0.2)
    assert watch.start().read() is None
    spin = None
    try:
        time.sleep(0.42)  # the watch's thread snapshots every 0.05 s from here on
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.12)
        others = watch.read()
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
        watch.stop()
    assert others is not None and others >= 0.4  # 0.12 s of a busy core in 0.2 s, over the slack
    assert ThreadGovernor(lambda: others, max_threads=2, poll_s=0.0)(0.0) == 1


def test_the_assembled_governor_reads_load_on_its_own_thread(tiny_gguf):
    from dlfp.assembly import build_engine
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from dlfp.protocol import Limits
    from dlfp.profiles import load_profile

    backend = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(2, 256, 64), n_threads=2))
    engine = build_engine(backend, "dlfp", load_profile("cpu-laptop"), probe_period_s=None, start=False)
    watches = [c for c in engine.companions if isinstance(c, LoadWatch)]
    assert len(watches) == 1 and engine.thread_governor is not None
    from dlfp.devices.pressure import cpu_stall_reader

    # Steps on two threads are watched for another program's contention where the kernel has PSI.
    assert (engine.contention_watch is not None) == (cpu_stall_reader() is not None)
    assert engine.contention_watch is None or engine.contention_watch in engine.companions
    engine.start()
    try:
        assert watches[0]._thread is not None and watches[0]._thread.is_alive()
    finally:
        engine.shutdown()
        backend.close()
    assert watches[0]._thread is None  # stopped with the engine


def test_llamacpp_switches_threads(tiny_gguf):
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from dlfp.protocol import BackendError, Limits, PrefillChunk, StepPlan

    backend = LlamaCppBackend(LlamaCppConfig(tiny_gguf, limits=Limits(1, 64, 32), n_threads=2))
    try:
        assert backend.threads == backend.max_threads == 2
        ids = backend.tokenize("hello there")
        before = backend.step(StepPlan(prefills=[PrefillChunk(0, ids, 0, True)])).logits[0]
        backend.free_sequence(0)
        assert backend.set_threads(1) and backend.threads == 1 and backend.describe()["threads_now"] == 1
        after = backend.step(StepPlan(prefills=[PrefillChunk(0, ids, 0, True)])).logits[0]
        assert int(before.argmax()) == int(after.argmax())
        with pytest.raises(BackendError):
            backend.set_threads(3)
    finally:
        backend.close()


class ThreadedSim(SimBackend):
    """SIMULATED: a 2-core device whose step threads wait on each other at every op. Alone,
    n threads run a step in 2/n of the 2-thread time; with a neighbour holding a core, 2
    threads take 30x (the barrier waits out the neighbour's time slices) and 1 thread 2x."""

    def __init__(self, neighbour, **kw):
        super().__init__(**kw)
        self.neighbour = neighbour
        self.threads = self.max_threads = 2

    def set_threads(self, n: int) -> bool:
        self.threads = n
        return True

    def duration(self, plan):
        slow = (30.0 if self.threads == 2 else 2.0) if self.neighbour() else 2.0 / self.threads
        return super().duration(plan) * slow


def test_engine_drops_a_thread_while_a_neighbour_spins_and_returns_after():
    """SIMULATED end to end: the governor switches threads, the controller relearns, the
    foreground holds the target in every phase once the switch has happened."""
    clock = VirtualClock()
    busy = (10.0, 25.0)
    neighbour = lambda: busy[0] <= clock.t < busy[1]  # noqa: E731
    backend = ThreadedSim(neighbour, cost=SimCost(attention_s=0.0), clock=clock, context=8192)
    params = TailParams(target_s=0.1, initial=4, minimum=2, maximum=256, quantum=2)
    engine = Engine(backend, TailDLFP(params), EngineConfig(preemption_budget_s=0.5), clock=clock.now)
    # The probe is scripted: a neighbour shows as one core of other programs' load.
    governor = ThreadGovernor(lambda: load(1.0 if neighbour() else 0.0), max_threads=2)
    engine.thread_governor = governor
    engine.start()
    fg = engine.submit(Request(list(range(3, 40)), 100_000, FOREGROUND, ignore_eos=True, request_id="fg"))
    engine.step_hooks.append(lambda rec: rec.t1 > 35.0 and fg.cancel())
    bg = [engine.submit(Request([1 + (i + j) % 900 for j in range(7000)], 4, BACKGROUND, request_id=f"bg{i}"))
          for i in range(2)]
    rec = fg.result(timeout=120)
    engine.shutdown(abort_pending=True)
    assert [n for _, n, _ in governor.transitions] == [1, 2]
    (t_down, _, _), (t_up, _, _) = governor.transitions
    assert busy[0] < t_down and busy[1] < t_up < busy[1] + 3.0
    steps = engine.trace.steps
    # At most two steps ran on both threads beside the neighbour (each one a 30x stall here).
    assert sum(1 for s in steps if busy[0] <= s.t0 < busy[1] and s.threads == 2) <= 2
    assert {s.threads for s in steps if t_down <= s.t0 < busy[1]} == {1}
    assert {s.threads for s in steps if s.t0 > t_up + 0.5} == {2}
    t = rec.token_times
    itls = lambda a, b: [y - x for x, y in zip(t, t[1:]) if a <= x < b]  # noqa: E731
    for a, b in ((2.0, busy[0]), (t_down + 1.0, busy[1]), (busy[1] + 4.0, 35.0)):
        window = sorted(itls(a, b))
        assert window and window[int(0.99 * (len(window) - 1))] <= 0.11, (a, b, window[-5:])
    # Background prefill went on at one thread beside the foreground, and more after.
    bg_busy = sum(s.n_prefill_bg for s in steps if t_down + 1.0 <= s.t0 < busy[1])
    bg_after = sum(s.n_prefill_bg for s in steps if busy[1] + 4.0 <= s.t0 < 35.0)
    assert bg_busy > 0 and bg_after > 0
    assert [n.split(" at ")[0] for n in engine.trace.notes if n.startswith("step threads")] == [
        "step threads 2 -> 1", "step threads 1 -> 2"]
    assert bg  # still running when the chat ended: the shutdown aborted them
    assert statistics.median(itls(t_down + 1.0, busy[1])) < 0.11



@pytest.mark.parametrize("policy", ["unbounded", "dlfp"])
def test_each_run_starts_on_the_threads_the_backend_was_loaded_with(policy):
    """A backend shared by runs in turn: the last run's governor left it on one thread, and
    the next run (governed or not, e.g. `unbounded` after the laptop job's decode-only run)
    starts on both again."""
    from dlfp.assembly import build_engine
    from dlfp.profiles import load_profile

    clock = VirtualClock()
    backend = ThreadedSim(lambda: False, clock=clock)
    backend.set_threads(1)
    engine = build_engine(backend, policy, load_profile("cpu-laptop"), probe_period_s=None, start=False,
                          clock=clock.now)
    assert backend.threads == 2
    assert (engine.thread_governor is None) == (policy == "unbounded")


def test_a_thread_change_scales_what_was_learned():
    """TailDLFP after a switch to half the threads: the learned costs, doubled, give the cap at
    once; without a factor it starts again from the initial cap."""
    params = TailParams(target_s=0.1, initial=4, minimum=1, maximum=256, quantum=1)
    policy = TailDLFP(params)
    for _ in range(40):  # a device where a decode costs 10 ms and a prompt token 5 ms
        policy.model.update(10.0, 0)
        policy.model.update(50.0, 8)
    policy.reset()
    quiet = policy.cap()
    policy.device_changed(2.0)
    assert policy.model.base_ms == pytest.approx(20.0, rel=0.05)
    assert policy.model.token_ms == pytest.approx(10.0, rel=0.05)
    slow = policy.cap()  # setpoint S: quiet = (S - 10) / 5, slow = (S - 20) / 10, floored
    assert 1 <= slow < quiet and abs(slow - (5 * quiet - 10) / 10) <= 1
    policy.device_changed()
    assert not policy.model.ready and policy.cap() == params.initial


def test_reduced_thread_steps_count_against_the_backends_threads():
    """A run that spent every step on one of two threads counts every step as reduced."""
    from dlfp.trace import StepRecord, control_counts

    steps = [StepRecord(0.0, 0.01, 0.01, 1, 0, 0, True, 0, None, threads=1) for _ in range(3)]
    assert control_counts(steps, 2) == {"zero_cap_steps": 3, "bg_steps_cut": 0, "steps_cut_for_contention": 0,
                                        "reduced_thread_steps": 3}
    assert control_counts(steps, None)["reduced_thread_steps"] == 0  # threads not under our control
    clock = VirtualClock()
    assert Engine(ThreadedSim(lambda: False, clock=clock), TailDLFP(TailParams(0.1, 4, 1, 64)),
                  clock=clock.now).trace.max_threads == 2
    assert Engine(SimBackend(clock=clock), TailDLFP(TailParams(0.1, 4, 1, 64)),
                  clock=clock.now).trace.max_threads is None


def test_an_arm_sets_the_contention_watch_from_its_profile(tiny_gguf):
    from dlfp.assembly import build_engine
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from dlfp.devices.pressure import cpu_stall_reader
    from dlfp.protocol import Limits
    from dlfp.profiles import load_profile

    if cpu_stall_reader() is None:
        pytest.skip("no /proc/pressure/cpu: no contention watch to set")
    backend = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(2, 256, 64), n_threads=2))
    try:
        profile = load_profile("cpu-laptop")
        default = build_engine(backend, "dlfp", profile, probe_period_s=None, start=False).contention_watch
        arm = build_engine(backend, "dlfp:contention_window_ms=40:contention_core_share=0.5", profile,
                           probe_period_s=None, start=False).contention_watch
    finally:
        backend.close()
    assert (default.window_s, default.core_share) == (profile.contention_window_ms / 1e3, profile.contention_core_share)
    assert (arm.window_s, arm.core_share) == (0.04, 0.5)
    for bad in ({"contention_window_ms": 0}, {"contention_core_share": 1.5}):
        with pytest.raises(ValueError, match="contention"):
            replace(profile, **bad)
