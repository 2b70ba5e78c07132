"""PyTorch backend (owned loop): a Llama/Qwen3-family decoder with a per-slot KV cache."""
from __future__ import annotations


def from_profile(model_path, profile, n_threads=None, **options):
    from dlfp.backends.torch.backend import from_profile as _from_profile  # torch imported only when used

    return _from_profile(model_path, profile, n_threads, **options)
