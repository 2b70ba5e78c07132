"""Every runtime dlfp runs against, by name: the one table the CLI, the bench and the
server read (names, kinds, default profiles, supported policies, how each loads).

Kinds:
- owned-loop: dlfp's engine drives every step over a `Backend` (llama.cpp, ExecuTorch,
  MLC step mode, torch, the SIMULATED latency model);
- external engine: the runtime schedules itself and a `RunTarget` steers it (vLLM with
  dlfp's scheduler plug-in, MLC-LLM's own engine);
- endpoint: any OpenAI-compatible server, named by URL (`dlfp bench --endpoint`),
  not by an entry here.

Loaders are imported only when a target is asked for: the core never imports an adapter.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

OWNED_LOOP = "owned-loop"
EXTERNAL = "external-engine"
ENDPOINT = "endpoint"


@dataclass(frozen=True)
class TargetEntry:
    name: str
    kind: str
    loader: str  # "module:function"; owned loop: (model, profile, **options) -> Backend,
    #               external: (model, profile, itl_target_ms=..., **options) -> RunTarget
    description: str
    default_profile: str = "cpu-laptop"
    policies: tuple[str, ...] | None = None  # policy families it runs (None: all of them)
    options: tuple[str, ...] = ()  # loader options the CLI may pass
    install: str = "see the README's Backends section"
    simulated: bool = False

    def check_policy(self, spec: str) -> None:
        family = spec.strip().split(":", 1)[0]
        if self.policies is not None and family not in self.policies:
            raise ValueError(f"{self.name} cannot run policy {spec!r}: it supports {', '.join(self.policies)}")

    def load(self, model: str | None, profile, **options):
        """The backend (owned loop) or run target (external engine), one clear error otherwise."""
        given = {k: v for k, v in options.items() if v not in (None, False)}
        unknown = set(given) - set(self.options)
        if unknown:
            raise ValueError(f"{self.name} takes no option {', '.join(sorted(unknown))}")
        module, attr = self.loader.split(":")
        try:
            return getattr(importlib.import_module(module), attr)(model, profile, **given)
        except ImportError as exc:  # at import, or when the loader reaches for its runtime
            raise ValueError(f"{self.name} is not installed ({exc}); {self.install}") from None


ALL = (
    TargetEntry("llamacpp", OWNED_LOOP, "dlfp.backends.llamacpp:from_profile",
                "llama.cpp (llama-cpp-python), one batch mixes decodes and chunks",
                options=("n_threads", "kv_unified"), install="run scripts/setup.sh"),
    TargetEntry("executorch", OWNED_LOOP, "dlfp.backends.executorch:from_profile",
                "ExecuTorch .pte in a worker process", options=("n_threads",),
                install="run scripts/setup.d/executorch.sh (setup.sh --all)"),
    TargetEntry("mlc", OWNED_LOOP, "dlfp.backends.mlc:from_profile",
                "MLC-named compiled functions on apache-tvm (step mode)", options=("n_threads",),
                install="run scripts/setup.d/mlc.sh (setup.sh --all)"),
    TargetEntry("torch", OWNED_LOOP, "dlfp.backends.torch:from_profile",
                "PyTorch Llama/Qwen3-family decoder, per-slot KV cache, CUDA events (a GPU) or the CPU; "
                "--model: a Hugging Face folder, or a bundled config (tiny, qwen3-0.6b, qwen3-8b) with random weights",
                options=("n_threads",),
                install="install torch (scripts/setup.d/executorch.sh puts the CPU build in .venv)"),
    TargetEntry("sim", OWNED_LOOP, "dlfp.sim:from_profile",
                "SIMULATED latency model for controller studies; never a measurement", simulated=True),
    TargetEntry("vllm", EXTERNAL, "dlfp.backends.vllm.target:make_target",
                "vLLM in-process with dlfp's scheduler plug-in (a GPU machine)", default_profile="a100-paper",
                options=("itl_target_ms",),
                install="pip install -e '.[nvidia]' vllm==0.32.0 on a GPU machine"),
    TargetEntry("mlc-engine", EXTERNAL, "dlfp.backends.mlc.engine_mode:make_target",
                "MLC-LLM's AsyncMLCEngine; background admission is the only lever",
                policies=("unbounded", "admission"), options=("itl_target_ms",), install="install MLC-LLM from its own channel (https://mlc.ai/wheels)"),
)
TARGETS: dict[str, TargetEntry] = {t.name: t for t in ALL}


def register(entry: TargetEntry) -> None:
    """Add (or replace) a target: how a third-party adapter plugs in."""
    TARGETS[entry.name] = entry


def target_names(kind: str | None = None) -> list[str]:
    return sorted(n for n, t in TARGETS.items() if kind is None or t.kind == kind)


def get_target(name: str) -> TargetEntry:
    if name not in TARGETS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(target_names())}")
    return TARGETS[name]


def load_backend(name: str, model: str | None, profile, **options):
    """An owned-loop backend by name (ValueError with one line if it cannot load)."""
    entry = get_target(name)
    if entry.kind != OWNED_LOOP:
        raise ValueError(f"{name} is an external engine, not a backend dlfp steps itself: use it with dlfp bench")
    return entry.load(model, profile, **options)
