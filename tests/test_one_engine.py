"""One engine behind every entry point: the assembly, the step observer, the target
registry and the parameters path (each defect here was reproduced on the tree before them)."""
import json

from dataclasses import replace

import pytest
from click.testing import CliRunner

from dlfp.assembly import build_engine, engine_config, is_stock
from dlfp.sim import SimBackend, VirtualClock
from dlfp.cli import main
from dlfp.paper import PaperDLFP
from dlfp.policy import COMPLETION, params_from_dict, params_to_dict, StepShape
from dlfp.tail import TailParams
from dlfp.devices.governor import ThermalGovernor
from dlfp.profiles import load_profile
from dlfp.observer import StepObserver
from dlfp.targets import EXTERNAL, OWNED_LOOP, TARGETS, get_target

LAPTOP = load_profile("cpu-laptop")


# -- the parameters path ------------------------------------------------------
def test_every_controller_parameter_survives_the_vllm_plugin_settings():
    from dlfp.backends.vllm.settings import PluginSettings, settings_from

    params = LAPTOP.controller_params(50)
    assert params.max_growth == 1.25  # the cpu-laptop profile's growth limit
    back = settings_from(PluginSettings("dlfp", params).as_config(), environ={})
    assert back.params == params  # max_growth was dropped (None) before the one path
    env = settings_from({}, environ={"DLFP_PROFILE": "cpu-laptop", "DLFP_MAX_GROWTH": "1.5"})
    assert env.params.max_growth == 1.5
    with pytest.raises(ValueError, match="max_growth"):
        settings_from({"dlfp": {"max_growth": "fast"}}, environ={})


def test_describe_and_config_carry_every_field():
    from dataclasses import fields

    params = TailParams(0.1, 4, 1, 256, 1, 1.25)
    out = params_to_dict(params)
    assert out["target_ms"] == 100.0 and out["max_growth"] == 1.25
    assert set(out) == {"target_ms"} | {f.name for f in fields(TailParams)} - {"target_s"}  # every field
    assert PaperDLFP(params).describe()["max_growth"] == 1.25
    assert params_from_dict(params_to_dict(params), LAPTOP.controller_params()) == params
    with pytest.raises(ValueError, match="unknown controller parameter"):
        params_from_dict({"target_s": 0.1}, params)


# -- the one assembly ---------------------------------------------------------
def sim():
    return SimBackend(clock=VirtualClock(), max_sequences=4, context=4096, max_batch_tokens=512)


@pytest.mark.parametrize("policy", ["dlfp", "dlfp-cadence", "fixed:8"])
def test_every_capped_policy_gets_the_budget_and_the_governor(policy):
    engine = build_engine(sim(), policy, LAPTOP, probe_period_s=0.5, start=False)
    assert isinstance(engine.background_gate, ThermalGovernor)
    assert engine.config.preemption_budget_s == LAPTOP.budget_s(cuts_steps=True) and engine.preemption is not None
    assert engine.companions  # the probe sampler starts and stops with the engine


def test_a_dlfp_arm_may_name_its_own_preemption_budget():
    engine = build_engine(sim(), "dlfp:preemption_budget_ms=150:quantile=0.995", LAPTOP, probe_period_s=None,
                          start=False)
    assert engine.config.preemption_budget_s == 0.15 and engine.policy.params.quantile == 0.995
    assert build_engine(sim(), "dlfp:preemption_budget_ms=0", LAPTOP, start=False).preemption is None
    assert build_engine(sim(), "dlfp", LAPTOP, start=False).config.preemption_budget_s == LAPTOP.budget_s(True)
    for bad, says in (("dlfp:preemption_budget_ms=x", "not a float"), ("dlfp:preemption_budget_ms=-1", ">= 0"),
                      ("dlfp:preemption_budget_ms=nan", "finite"), ("dlfp:preemption_budget_ms=inf", "finite")):
        with pytest.raises(ValueError, match=says):
            build_engine(sim(), bad, LAPTOP, start=False)


def test_the_budget_is_longer_where_the_backend_cuts_a_step_at_an_arrival():
    """An arrival cuts a step on a backend that declares cut_steps, so the budget there bounds only
    the work thrown away (cut_budget_ms); elsewhere an arrival waits for the step (preemption_budget_ms).
    A budget an arm names holds on both."""
    assert LAPTOP.cut_budget_ms > LAPTOP.preemption_budget_ms > 0
    cutting, waiting = sim(), sim()
    waiting.capabilities = replace(waiting.capabilities, cut_steps=False)
    assert build_engine(cutting, "dlfp", LAPTOP, start=False).config.preemption_budget_s == LAPTOP.cut_budget_ms / 1e3
    assert build_engine(waiting, "dlfp", LAPTOP, start=False).config.preemption_budget_s == LAPTOP.preemption_budget_ms / 1e3
    for backend in (cutting, waiting):
        named = build_engine(backend, "dlfp:preemption_budget_ms=150", LAPTOP, start=False)
        assert named.config.preemption_budget_s == 0.15
    both = build_engine(cutting, "dlfp:preemption_budget_ms=150:cut_budget_ms=400", LAPTOP, start=False)
    assert both.config.preemption_budget_s == 0.4
    assert build_engine(cutting, "dlfp:preemption_budget_ms=0", LAPTOP, start=False).preemption is None
    assert engine_config("dlfp", replace(LAPTOP, cut_budget_ms=0), cuts_steps=True).preemption_budget_s == 0.1


def test_the_laptop_job_builds_each_arm_from_its_spec(monkeypatch):
    """`dlfp laptop --policies dlfp:preemption_budget_ms=150` runs under that budget: each session's
    engine is built from the arm's spec (a policy built beforehand would lose what the spec says
    of the profile)."""
    import dlfp.laptop as laptop
    from dlfp.trace import Trace

    built = []

    def session(backend, policy, settings, label, *rest):
        built.append(build_engine(backend, policy, settings.profile, itl_target_ms=settings.itl_target_ms,
                                  probe_period_s=None, start=False))
        if len(built) == 2:
            raise RuntimeError("built")
        return laptop.Session(label, Trace(0.0), 0.0, 0.0)

    monkeypatch.setattr(laptop, "run_session", session)
    settings = laptop.LaptopSettings(["dlfp:preemption_budget_ms=150"], 50.0, LAPTOP, None, [], probe_period_s=None)
    with pytest.raises(RuntimeError, match="built"):
        laptop.run_laptop(sim(), settings)
    assert built[1].config.preemption_budget_s == 0.15 and built[1].policy.params.target_s == 0.05


def test_unbounded_is_the_stock_runtime_everywhere():
    engine = build_engine(sim(), "unbounded", LAPTOP, probe_period_s=0.5, start=False)
    assert engine.background_gate is None and engine.preemption is None
    assert is_stock("unbounded") and not is_stock("dlfp")
    assert engine_config("unbounded", LAPTOP).preemption_budget_s is None
    from dlfp.backends.vllm.target import engine_args
    from dlfp.backends.vllm.settings import PluginSettings

    prof = load_profile("a100-paper")
    stock = engine_args("m", prof, PluginSettings("unbounded", prof.controller_params()))
    assert "scheduler_cls" not in stock  # the same rule decides the vLLM target's plug-in


def test_bench_engine_target_runs_the_governor(tiny_gguf):
    """`dlfp bench` never attached the governor before: only the laptop job did."""
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from dlfp.protocol import Limits
    from dlfp.bench.target import EngineTarget

    backend = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(2, 256, 64), n_threads=1))
    try:
        target = EngineTarget(backend, LAPTOP, probe_period_s=0.5)
        target.open("dlfp")
        assert isinstance(target.engine.background_gate, ThermalGovernor)
        trace = target.close()
        assert trace.samples  # the engine's own sampler wrote probe readings
    finally:
        backend.close()


def test_serve_builds_its_engine_with_the_governor(tiny_gguf, monkeypatch):
    """`dlfp serve` never gated background work on temperature before."""
    pytest.importorskip("fastapi")
    from dlfp.server import runner

    monkeypatch.setattr(runner.DrainingServer, "run", lambda self: None)
    captured = {}
    real_init = runner.DrainingServer.__init__

    def init(self, state, *a, **kw):
        captured["state"] = state
        real_init(self, state, *a, **kw)

    monkeypatch.setattr(runner.DrainingServer, "__init__", init)
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_gguf), "--threads", "1", "--policy", "dlfp"])
    assert result.exit_code == 0, result.output
    engine = captured["state"].engine
    assert isinstance(engine.background_gate, ThermalGovernor) and engine.companions
    assert b"dlfp_background_held" in captured["state"].metrics.render()


# -- the one step observer ----------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_observer_drops_a_stamp_from_before_a_reset():
    """A step planned before the foreground went idle must not move the next burst's cap."""
    clock = Clock()
    policy = PaperDLFP(TailParams(0.1, 8, 1, 64, 1), COMPLETION)
    obs = StepObserver(policy, clock)
    shape = StepShape(n_decode=1, n_prefill=8)
    cap = obs.begin(guarded=True)
    obs.scheduled("a", True, cap, shape)  # in flight (async)
    obs.begin(guarded=False)  # the decode burst ended: reset
    clock.t = 1.0  # a very slow completion arrives late
    rec = obs.completed("a")
    assert rec.observed_s is None and policy.cap() == 8  # not observed: stale epoch
    cap = obs.begin(guarded=True)
    obs.scheduled("b", True, cap, shape)
    clock.t = 1.2
    obs.completed("b")
    assert policy.cap() == 4  # 8 * 0.1 / 0.2: a current stamp is observed


def test_engine_and_vllm_plugin_share_one_observer():
    from dlfp.engine import Engine

    engine = Engine(sim(), PaperDLFP(LAPTOP.controller_params()))
    assert type(engine.observer) is StepObserver
    src = (__import__("pathlib").Path(__file__).parents[1] / "backends/vllm/scheduler.py").read_text()
    assert "from dlfp.observer import StepObserver" in src


def test_synchronous_engine_observes_the_backends_completed_time():
    clock = VirtualClock()
    backend = SimBackend(clock=clock)
    engine = build_engine(backend, "dlfp", LAPTOP, probe_period_s=None, clock=clock.now)
    from dlfp.sequence import BACKGROUND, Request

    fg = engine.submit(Request(list(range(1, 20)), 40, ignore_eos=True))
    bg = engine.submit(Request(list(range(1, 400)), 2, BACKGROUND, ignore_eos=True))
    fg.result(timeout=60), bg.result(timeout=60)
    engine.shutdown()
    observed = [s for s in engine.trace.steps if s.observed_s is not None]
    assert observed and all(s.guarded for s in observed) and any(s.capped for s in observed)
    assert all(s.observed_s == s.duration_s for s in observed)  # completion = the backend's own figure


# -- the target registry, through the CLI -------------------------------------
def test_registry_entries_are_complete():
    assert {"llamacpp", "executorch", "mlc", "sim", "vllm", "mlc-engine"} <= set(TARGETS)
    for t in TARGETS.values():
        assert t.kind in (OWNED_LOOP, EXTERNAL) and ":" in t.loader and t.description
    assert get_target("vllm").default_profile == "a100-paper"
    with pytest.raises(ValueError, match="cannot run policy"):
        get_target("mlc-engine").check_policy("fixed:8")


BENCH = ["bench", "--workload", "laptop", "--scale", "0.05", "--requests", "2", "--rate", "20", "--warmup", "0",
         "--probe-period-s", "0", "--seeds", "3", "--policies", "unbounded,dlfp"]


def test_bench_cli_runs_the_sim_target(tmp_path):
    result = CliRunner().invoke(main, BENCH + ["--backend", "sim", "--prompts", "random", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in rows} == {"unbounded", "dlfp"} and all(r["reconciled"] for r in rows)


def test_bench_cli_runs_the_llamacpp_target(tiny_gguf, tmp_path):
    result = CliRunner().invoke(main, BENCH + ["--model", str(tiny_gguf), "--threads", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["controller"]["max_growth"] == 1.25 if "controller" in config else True


@pytest.mark.parametrize("name", ["vllm", "mlc-engine"])
def test_bench_cli_refuses_an_external_engine_it_cannot_run_in_one_line(name, tmp_path):
    """`--backend mlc-engine` answered "unknown backend" before: it was never routed."""
    result = CliRunner().invoke(main, BENCH + ["--backend", name, "--model", "m", "--policies", "unbounded",
                                               "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert f"backend '{name}' cannot run here" in result.output, result.output
    assert "unknown backend" not in result.output and "Traceback" not in result.output


def test_bench_cli_refuses_a_policy_the_target_cannot_run(tmp_path):
    result = CliRunner().invoke(main, BENCH + ["--backend", "mlc-engine", "--policies", "unbounded,fixed:8",
                                               "--out", str(tmp_path)])
    assert result.exit_code != 0 and "cannot run policy 'fixed:8'" in result.output


def test_unknown_backend_lists_the_registry(tmp_path):
    result = CliRunner().invoke(main, BENCH + ["--backend", "nope", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "unknown backend 'nope'" in result.output and "mlc-engine" in result.output
