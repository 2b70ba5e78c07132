"""Next-token choice from a row of logits: greedy, or temperature with top-p."""
from __future__ import annotations

import numpy as np

from dlfp.sequence import SamplingParams


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if not np.all(np.isfinite(logits)):
        raise ValueError("the model returned non-finite logits")
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        kept = probs[keep] / probs[keep].sum()
        return int(keep[rng.choice(len(keep), p=kept)])
    return int(rng.choice(len(probs), p=probs))
