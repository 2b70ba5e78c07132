"""Deterministic exact-token prompts.

Prompts are token ids drawn from a seed, so every policy, backend and rerun sees
the same input, and the prompt length is exact (no tokenizer in between). Each
request of a run starts with a different token, so no two prompts share a prefix
(a prefix cache cannot help) unless a shared prefix is asked for. Ids come from
the upper seven eighths of the vocabulary, away from the control tokens that
tokenizers keep at low ids.
"""
from __future__ import annotations

import hashlib

import numpy as np


def usable_ids(vocab_size: int) -> tuple[int, int]:
    """[low, high) range of ids prompts are drawn from."""
    if vocab_size < 16:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for synthetic prompts")
    return vocab_size // 8, vocab_size


def make_prompts(
    lengths: list[int], vocab_size: int, seed: int, shared_prefix: int = 0
) -> list[list[int]]:
    """One prompt per length; the first `shared_prefix` tokens are common to all.

    Without a shared prefix, the first tokens are distinct across requests.
    """
    low, high = usable_ids(vocab_size)
    if shared_prefix == 0 and len(lengths) > high - low:
        raise ValueError(f"{len(lengths)} nonmatching prompts need more than {high - low} distinct first tokens")
    rng = np.random.default_rng([seed, 0x70726F6D])
    prefix = rng.integers(low, high, size=shared_prefix).tolist()
    firsts = rng.choice(np.arange(low, high), size=len(lengths), replace=False).tolist() if lengths else []
    prompts = []
    for i, n in enumerate(lengths):
        if n < 1 or n <= shared_prefix:
            raise ValueError(f"prompt length {n} must exceed the shared prefix of {shared_prefix}")
        body = rng.integers(low, high, size=n - shared_prefix).tolist()
        if shared_prefix == 0:
            body[0] = firsts[i]
        prompts.append(prefix + body)
    return prompts


def fingerprint(prompts: list[list[int]]) -> str:
    """A short hash of every token id of every prompt, in order."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]
