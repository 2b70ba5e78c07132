"""MLC-LLM adapters.

- step mode (`from_profile`, the registry's `mlc`): dlfp owns the loop over a compiled
  model's MLC-named functions on apache-tvm (`step.py`);
- engine mode (`engine_mode.make_target`, the bench target `mlc-engine`): MLC-LLM's own
  AsyncMLCEngine, steered only by background admission.
"""
from __future__ import annotations


def from_profile(model_path: str | None, profile, n_threads: int | None = None):
    """The registry's factory: step mode, sized from the device profile."""
    from dlfp.protocol import ModelLoadError

    if model_path is None:
        raise ModelLoadError("the mlc backend needs --model DIR (build a tiny one: python -m dlfp.backends.mlc.build_tiny DIR)")
    from dlfp.backends.mlc.step import MLCStepBackend, StepConfig

    return MLCStepBackend(
        StepConfig(
            model_dir=str(model_path),
            limits=profile.limits,
            n_threads=n_threads,
        )
    )
