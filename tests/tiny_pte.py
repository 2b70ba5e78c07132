"""A tiny random-weight ExecuTorch program, exported once per test session (~1 minute)."""
from __future__ import annotations

import functools
from pathlib import Path

# Small enough to lower fast, long enough for the conformance suite's prompts.
TINY = dict(dim=64, layers=2, heads=4, ffn=128, max_seq_len=512, max_chunk=160, seed=0)


PACKED_SLOTS = 4


@functools.lru_cache(maxsize=None)
def tiny_pte(folder: Path, slots: int = 0) -> Path:
    """Export into `folder` (the session's base temp dir) once; later calls reuse the file.

    slots=0: the per-sequence layout; slots=n: the packed layout (same weights, same seed).
    """
    import warnings

    from dlfp.backends.executorch_export import TinyConfig, export_tiny

    out = Path(folder) / "executorch" / (f"tiny-packed{slots}.pte" if slots else "tiny.pte")
    if not out.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_tiny(out, TinyConfig(**TINY, slots=slots))
    return out


def tiny_packed_pte(folder: Path) -> Path:
    return tiny_pte(folder, PACKED_SLOTS)
