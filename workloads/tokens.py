"""Deterministic exact-token prompts.

Prompts are token ids chosen from a seed, so every policy, backend and rerun sees
the same input, and the prompt length is exact. Two sources:

- text (the default where the target has a tokenizer): windows of a tokenized
  text corpus at distinct seeded offsets. Natural text gives the model clear
  next-token choices; uniformly random ids leave near-ties in the logits (top-2
  margins of 0.004 seen with SmolLM2-135M), and there a chunked prefill flips a
  greedy token against a whole one, so exact-output checks would fail for a
  reason that is not the policy.
- random: ids drawn uniformly from the upper seven eighths of the vocabulary
  (away from the control tokens tokenizers keep at low ids); each request
  starts with a different id.

Either way no two prompts share a prefix (a prefix cache cannot help) unless a
shared prefix is asked for.
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
    lengths: list[int], vocab_size: int, seed: int, shared_prefix: int = 0, pool: list[int] | None = None
) -> list[list[int]]:
    """One prompt per length; the first `shared_prefix` tokens are common to all.

    With `pool` (a tokenized text), prompts are windows of it; otherwise random ids
    whose first tokens are distinct across requests.
    """
    if pool:
        return _text_prompts(lengths, pool, seed, shared_prefix)
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


def _text_prompts(lengths: list[int], pool: list[int], seed: int, shared_prefix: int) -> list[list[int]]:
    """Windows of the (cycled) pool at distinct offsets whose first two tokens differ."""
    rng = np.random.default_rng([seed, 0x74657874])
    n = len(pool)
    ring = np.asarray(pool, dtype=np.int64)
    prefix = ring[np.arange(shared_prefix) % n].tolist()
    starts, seen = [], set()
    for offset in rng.permutation(n).tolist():
        key = (pool[offset], pool[(offset + 1) % n])
        if key not in seen:
            seen.add(key)
            starts.append(offset)
        if len(starts) == len(lengths):
            break
    if len(starts) < len(lengths):
        raise ValueError(f"the text pool ({n} tokens) has too few distinct openings for {len(lengths)} prompts")
    prompts = []
    for start, length in zip(starts, lengths):
        if length < 1 or length <= shared_prefix:
            raise ValueError(f"prompt length {length} must exceed the shared prefix of {shared_prefix}")
        body = ring[(start + np.arange(length - shared_prefix)) % n].tolist()
        prompts.append(prefix + body)
    return prompts


def text_pool(tokenize) -> list[int]:
    """The bundled sample documents, tokenized by the target's tokenizer."""
    from dlfp.workloads.laptop import load_documents

    return tokenize("\n\n".join(d.text.strip() for d in load_documents()))
