"""What a benchmark trial runs against.

The harness opens a target under one policy, submits requests on the arrival
schedule, and closes it to get the trace. In-process it is dlfp's own engine over
a backend; other targets (an OpenAI-compatible endpoint, vLLM in-process) follow
the same three calls, so every kind lands in the same files and tables.
"""
from __future__ import annotations

from typing import Protocol

from dlfp.assembly import build_engine
from dlfp.protocol import Backend
from dlfp.policy import params_to_dict
from dlfp.profiles import DeviceProfile
from dlfp.engine import Engine
from dlfp.prefix_cache import DEFAULT_HOLD_S
from dlfp.sequence import Request
from dlfp.trace import RequestRecord, Trace


class RequestHandleLike(Protocol):
    request_id: str

    def result(self, timeout: float | None = None) -> RequestRecord: ...


class RunTarget(Protocol):
    label: str

    def open(self, policy: str) -> None:
        """Start a run under `policy` (unbounded, dlfp, dlfp-cadence, fixed:N)."""

    def submit(self, request: Request) -> RequestHandleLike:
        """Send one request now; raises ValueError (recorded) if it is refused outright."""

    def close(self) -> Trace:
        """Wait for everything submitted, stop, and return the run's trace."""

    def describe(self) -> dict:
        """Backend, model, versions: what config.json records about the target."""


class EngineTarget:
    """dlfp's own engine over an owned-loop backend (llama.cpp, ExecuTorch, MLC, torch, sim)."""

    def __init__(self, backend: Backend, profile: DeviceProfile, itl_target_ms: float | None = None,
                 probe_period_s: float | None = None, prefix_hold_s: float = DEFAULT_HOLD_S):
        self.backend = backend
        self.profile = profile
        self.itl_target_ms = itl_target_ms
        self.params = profile.controller_params(itl_target_ms)
        self.probe_period_s = probe_period_s
        self.prefix_hold_s = prefix_hold_s
        self.label = backend.name
        self.engine: Engine | None = None

    def open(self, policy: str) -> None:
        self.engine = build_engine(self.backend, policy, self.profile, itl_target_ms=self.itl_target_ms,
                                   probe_period_s=self.probe_period_s, prefix_hold_s=self.prefix_hold_s)

    def submit(self, request: Request):
        assert self.engine is not None, "open() first"
        return self.engine.submit(request)

    def close(self) -> Trace:
        assert self.engine is not None, "open() first"
        self.engine.shutdown(abort_pending=False)
        trace, self.engine = self.engine.trace, None
        return trace

    def describe(self) -> dict:
        return self.backend.describe() | {"profile": self.profile.name, "controller": params_to_dict(self.params)}
