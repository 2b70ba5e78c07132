"""Next-token choice from a row of logits: greedy, or temperature with top-p."""
from __future__ import annotations

import numpy as np

from dlfp.sequence import SamplingParams


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if not np.all(np.isfinite(logits)):
        raise ValueError("the model returned non-finite logits")
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    probs = softmax(logits, params.temperature)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        kept = probs[keep] / probs[keep].sum()
        return int(keep[rng.choice(len(keep), p=kept)])
    return int(rng.choice(len(probs), p=probs))


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Probabilities at `temperature` > 0, finite for any finite logits and temperature.

    The maximum is subtracted before dividing, so every exponent is <= 0: a tiny
    temperature (5e-324) sends the others to -inf (probability 0) and leaves the
    maximum at exactly 1, i.e. greedy among the tied maxima, never inf/inf = NaN.
    """
    row = logits.astype(np.float64)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = (row - row.max()) / temperature
    probs = np.exp(scaled)
    return probs / probs.sum()
