"""Backends by name, imported only when asked for (the core never imports one)."""
from __future__ import annotations

import importlib
from typing import Callable

from dlfp.backends.protocol import Backend

# name -> "module:factory"; a factory takes (model_path, profile, **options).
_FACTORIES = {
    "llamacpp": "dlfp.backends.llamacpp:from_profile",
    "executorch": "dlfp.backends.executorch:from_profile",
    "mlc": "dlfp.backends.mlc:from_profile",
    "torch": "dlfp.backends.torch:from_profile",
}


def backend_names() -> list[str]:
    return sorted(_FACTORIES)


def register(name: str, target: str) -> None:
    _FACTORIES[name] = target


def load_backend(name: str, model_path: str | None, profile, **options) -> Backend:
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(backend_names())}")
    module, attr = _FACTORIES[name].split(":")
    try:
        factory: Callable[..., Backend] = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ValueError(f"backend {name!r} is not installed ({exc}); see README for its extra") from None
    return factory(model_path, profile, **options)
