"""Prometheus metrics: per-class TTFT/ITL, step duration, the cap in force, queue depth."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dlfp.engine import Engine
from dlfp.prefix_cache import EVICTION_REASONS
from dlfp.sequence import PRIORITIES
from dlfp.trace import StepRecord

# Seconds. ITL buckets are dense around a CPU laptop's 100 ms goal.
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    """One registry per server, so several servers (tests) never share counters."""

    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("dlfp_time_to_first_token_seconds", "Arrival to first token, per class",
                              ["priority"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("dlfp_inter_token_latency_seconds", "Gap between consecutive tokens, per class",
                             ["priority"], buckets=ITL_BUCKETS, registry=r)
        self.step = Histogram("dlfp_step_duration_seconds", "Completed engine step time",
                              ["guarded"], buckets=STEP_BUCKETS, registry=r)
        self.prefill = Counter("dlfp_prefill_tokens", "Prompt tokens processed, per class", ["priority"], registry=r)
        self.prompt = Counter("dlfp_prompt_tokens", "Prompt tokens of requests that produced tokens, per class, "
                              "reused from a cached prefix or computed", ["priority", "source"], registry=r)
        self.generated = Counter("dlfp_generation_tokens", "Tokens sent to clients, per class", ["priority"],
                                 registry=r)
        self.finished = Counter("dlfp_requests", "Finished requests, per class and the finish reason the client saw "
                                "(abort: cut short, by a hang-up or the shutdown)",
                                ["priority", "finish_reason"], registry=r)
        self.rejected = Counter("dlfp_requests_rejected", "Requests refused before the engine, per status code",
                                ["status"], registry=r)
        load = engine.load
        Gauge("dlfp_prefill_cap_tokens", "The prefill cap of the latest guarded step (NaN: uncapped, or none yet)",
              registry=r).set_function(lambda: _or_nan(load()["cap"]))
        waiting = Gauge("dlfp_requests_waiting", "Requests queued for a sequence slot, per class",
                        ["priority"], registry=r)
        for p in PRIORITIES:
            waiting.labels(p).set_function(lambda p=p: load()[f"waiting_{p}"])
        Gauge("dlfp_requests_running", "Requests holding a sequence slot",
              registry=r).set_function(lambda: load()["running"])
        Gauge("dlfp_free_sequence_slots", "Sequence slots (KV cache) free",
              registry=r).set_function(lambda: len(engine.scheduler.free_slots))
        Gauge("dlfp_background_held", "1 while the thermal governor holds background prefill back",
              registry=r).set_function(lambda: _held(engine))
        Gauge("dlfp_step_threads", "Threads the backend's steps run on (lowered while other programs hold cores)",
              registry=r).set_function(lambda: _or_nan(engine.backend.threads))
        self.rules = Counter("dlfp_guarded_steps", "Guarded steps per decision rule: what set the cap "
                             "(dlfp.policy.RULES)", ["rule"], registry=r)
        Gauge("dlfp_controller_setpoint_seconds", "The step time the latest guarded decision planned for "
              "(target / margin; NaN: none yet)", registry=r).set_function(lambda: _setpoint_s(engine))
        evictions = Gauge("dlfp_slot_evictions", "Cached slot contents dropped for another request, per reason "
                          "(dlfp.prefix_cache)", ["reason"], registry=r)
        for reason in EVICTION_REASONS:
            evictions.labels(reason).set_function(lambda reason=reason: engine.trace.slot_evictions.get(reason, 0))
        self.in_flight = Gauge("dlfp_requests_in_flight", "Requests accepted and not yet finished", registry=r)
        engine.step_hooks.append(self.on_step)

    def on_step(self, rec: StepRecord) -> None:  # engine thread; prometheus_client is thread-safe
        self.step.labels("yes" if rec.guarded else "no").observe(rec.duration_s)
        self.prefill.labels("foreground").inc(rec.n_prefill_fg)
        self.prefill.labels("background").inc(rec.n_prefill_bg)
        if rec.rule is not None:
            self.rules.labels(rec.rule).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _held(engine: Engine) -> float:
    governor = engine.background_gate
    return 1.0 if getattr(governor, "reason", None) is not None else 0.0


def _setpoint_s(engine: Engine) -> float:
    decision = engine.observer.decision
    return float("nan") if decision is None or decision.setpoint_ms is None else decision.setpoint_ms / 1e3


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)
