"""One assembly: a running engine from (backend, policy, device profile, target, probes).

Every entry point builds its engine here (`dlfp laptop`, `generate`, `serve`,
`bench` and the conformance suite), so what a policy implies is decided once:

- `unbounded` stands for the stock runtime (llama.cpp's server): whole pending
  prompts up to the batch size, no preemption budget, no thermal governor; the
  vLLM target runs stock vLLM for it, without the plug-in (`is_stock`).
- every other policy gets the profile's preemption budget (isolated background
  prefill is split so one step stays within it), and, whenever probes are sampled,
  the thermal governor gating background prefill and the thread governor running
  the steps on fewer threads while other programs hold cores (where the backend
  can switch: llama.cpp);
- a `dlfp:` spec may name `preemption_budget_ms=V` among its overrides: that arm's
  profile with that budget (`arm_profile`), so budgets compare side by side in one run;
- the observation source is the policy's own (`dlfp` completion, `dlfp-cadence`
  the paper's proxy), applied by the one step observer.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Callable

from dlfp.protocol import Backend
from dlfp.contention import ContentionWatch
from dlfp.controller import parse_policy
from dlfp.policy import PrefillPolicy, Unbounded
from dlfp.profiles import DeviceProfile
from dlfp.engine import Engine, EngineConfig
from dlfp.prefix_cache import DEFAULT_HOLD_S
from dlfp.trace import Trace

log = logging.getLogger("dlfp.assembly")

STOCK_POLICY = "unbounded"


def is_stock(policy: PrefillPolicy | str) -> bool:
    """The stock runtime: no cap, no budget, no governor, no plug-in."""
    return isinstance(policy, Unbounded) or (isinstance(policy, str) and policy.strip() == STOCK_POLICY)


# Profile fields a `dlfp:` spec may name: what an arm varies beside the controller's parameters.
PROFILE_OVERRIDES = ("preemption_budget_ms", "cut_budget_ms", "contention_window_ms", "contention_core_share")


def arm_profile(spec: str | PrefillPolicy, profile: DeviceProfile) -> tuple[str | PrefillPolicy, DeviceProfile]:
    """The spec without its profile overrides, and the profile with them
    (`dlfp:preemption_budget_ms=150:quantile=0.995` -> `dlfp:quantile=0.995`, budget 150 ms).
    A budget an arm names holds on every backend, one that cuts steps too, unless the arm
    also names `cut_budget_ms`."""
    if not isinstance(spec, str) or not spec.strip().startswith("dlfp:"):
        return spec, profile
    kept, changes = [], {}
    for pair in spec.strip().split(":")[1:]:
        name, _, text = pair.partition("=")
        if name not in PROFILE_OVERRIDES:
            kept.append(pair)
            continue
        try:
            changes[name] = float(text)
        except ValueError:
            raise ValueError(f"dlfp parameter {pair!r}: {text!r} is not a float") from None
        if not 0 <= changes[name] < math.inf:  # NaN fails too
            raise ValueError(f"dlfp parameter {pair!r}: needs a finite value >= 0 (0: no budget)")
    if "preemption_budget_ms" in changes:
        changes.setdefault("cut_budget_ms", 0.0)
    return ":".join(["dlfp", *kept]), replace(profile, **changes)


def make_policy(spec: str | PrefillPolicy, profile: DeviceProfile, itl_target_ms: float | None = None) -> PrefillPolicy:
    """A fresh policy from its name, with the profile's controller parameters."""
    if isinstance(spec, PrefillPolicy):
        return spec
    spec, profile = arm_profile(spec, profile)
    return parse_policy(spec, profile.controller_params(itl_target_ms))


def engine_config(policy: PrefillPolicy | str, profile: DeviceProfile, seed: int = 0,
                  prefix_hold_s: float = DEFAULT_HOLD_S, cuts_steps: bool = False) -> EngineConfig:
    budget = None if is_stock(policy) else profile.budget_s(cuts_steps)
    return EngineConfig(preemption_budget_s=budget, preemption_initial=profile.preemption_initial, seed=seed,
                        prefix_hold_s=prefix_hold_s, ttft_goal_s=profile.ttft_goal_ms / 1e3)


def build_engine(
    backend: Backend,
    policy: str | PrefillPolicy,
    profile: DeviceProfile,
    *,
    itl_target_ms: float | None = None,
    probe_period_s: float | None = 0.5,
    governor: bool = True,
    trace: Trace | None = None,
    clock: Callable[[], float] = time.perf_counter,
    start: bool = True,
    prefix_hold_s: float = DEFAULT_HOLD_S,
) -> Engine:
    """The engine for one run. `probe_period_s=None` samples no probes (and so runs no
    thermal governor: it would have nothing to read); `governor=False` runs neither the
    thermal nor the thread governor. `prefix_hold_s`: how long a conversation's cached
    prefix is kept from background requests."""
    policy, profile = arm_profile(policy, profile)
    pol = make_policy(policy, profile, itl_target_ms)
    _all_threads(backend)
    config = engine_config(pol, profile, prefix_hold_s=prefix_hold_s, cuts_steps=backend.capabilities.cut_steps)
    engine = Engine(backend, pol, config, trace=trace, clock=clock)
    sampler = _sampler(engine, probe_period_s)
    if sampler is not None:
        engine.companions.append(sampler)
        if governor and not is_stock(pol):
            from dlfp.devices.governor import ThermalGovernor

            # Background prefill yields to heat, throttling and a low battery; the foreground never does.
            engine.background_gate = ThermalGovernor.for_profile(profile, source=sampler.latest)
    if governor and not is_stock(pol):
        engine.thread_governor = _thread_governor(engine, backend)
        if engine.thread_governor is not None:
            engine.contention_watch = _contention_watch(engine, backend, profile)
    return engine.start() if start else engine


def _all_threads(backend: Backend) -> None:
    """Every run starts on the threads the backend was loaded with. A backend serves several
    runs in turn (the laptop job's sessions, the bench's arms) and keeps the thread count the
    last run's governor left; a run without a governor (`unbounded`, the stock runtime) would
    otherwise run every step on it, and a governed run would start from it."""
    if backend.max_threads and backend.threads is not None and backend.threads != backend.max_threads:
        backend.set_threads(backend.max_threads)


def _thread_governor(engine: Engine, backend: Backend):
    """Fewer step threads while other programs hold cores, where the backend can switch.
    Other programs' load is snapshotted on its own thread (a companion of the engine), so the
    figure the governor sees between steps covers the last read period up to that moment, not
    the whole step before."""
    if (backend.max_threads or 0) <= 1 or backend.threads is None:
        return None
    try:
        from dlfp.devices.cpu import LoadWatch
    except ImportError as exc:  # psutil missing: the steps keep their threads
        log.warning("no thread governor (%s)", exc)
        return None
    from dlfp.devices.threads import READ_S, ThreadGovernor

    watch = LoadWatch(period_s=READ_S)
    engine.companions.append(watch)
    return ThreadGovernor(watch.read, backend.max_threads, poll_s=0.0)  # two /proc reads a step


def _contention_watch(engine: Engine, backend: Backend, profile: DeviceProfile):
    """Cuts a guarded step on several threads once another program slows it, where the backend
    can cut a step and the kernel reports CPU pressure (dlfp/contention.py)."""
    if not backend.capabilities.cut_steps:
        return None
    from dlfp.devices.pressure import cpu_stall_reader

    stalled = cpu_stall_reader()
    if stalled is None:
        log.info("no CPU pressure counter (/proc/pressure/cpu): steps are cut at their deadline only")
        return None
    watch = ContentionWatch(stalled, backend.cut_step, core_share=profile.contention_core_share,
                            window_s=profile.contention_window_ms / 1e3)
    engine.companions.append(watch)
    return watch


def _sampler(engine: Engine, period_s: float | None):
    if not period_s:
        return None
    try:
        from dlfp.devices.sampler import ProbeSampler
    except ImportError as exc:  # psutil missing: probes are optional, the run is not
        log.warning("probes unavailable (%s): no probe samples and no thermal governor", exc)
        return None
    return ProbeSampler(engine.trace, period_s=period_s)
