"""What a benchmark trial runs against.

The harness opens a target under one policy, submits requests on the arrival
schedule, and closes it to get the trace. In-process it is dlfp's own engine over
a backend; other targets (an OpenAI-compatible endpoint, vLLM in-process) follow
the same three calls, so every kind lands in the same files and tables.
"""
from __future__ import annotations

import importlib
from typing import Protocol

from dlfp.backends.protocol import Backend
from dlfp.controller import parse_policy
from dlfp.devices.profiles import DeviceProfile
from dlfp.engine import Engine, EngineConfig
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
    """dlfp's own engine over an owned-loop backend (llama.cpp, ExecuTorch, MLC, sim)."""

    def __init__(self, backend: Backend, profile: DeviceProfile, itl_target_ms: float | None = None):
        self.backend = backend
        self.profile = profile
        self.params = profile.dlfp_params(itl_target_ms)
        self.label = backend.name
        self.engine: Engine | None = None

    def open(self, policy: str) -> None:
        pol = parse_policy(policy, self.params)
        self.engine = Engine(self.backend, pol, EngineConfig.for_policy(pol, self.profile)).start()

    def submit(self, request: Request):
        assert self.engine is not None, "open() first"
        return self.engine.submit(request)

    def close(self) -> Trace:
        assert self.engine is not None, "open() first"
        self.engine.shutdown(abort_pending=False)
        trace, self.engine = self.engine.trace, None
        return trace

    def describe(self) -> dict:
        return self.backend.describe() | {"profile": self.profile.name, "controller": vars(self.params)}


# Targets that are not "dlfp engine over a backend": backend name -> "module:factory".
# A factory takes (model, profile, **options) and returns a RunTarget.
EXTERNAL_TARGETS = {
    "vllm": "dlfp.backends.vllm.target:make_target",
    "mlc-engine": "dlfp.backends.mlc.engine_mode:make_target",
}


def make_external_target(name: str, model: str | None, profile: DeviceProfile, **options) -> RunTarget:
    module, attr = EXTERNAL_TARGETS[name].split(":")
    return getattr(importlib.import_module(module), attr)(model, profile, **options)
