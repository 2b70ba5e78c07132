"""What a step costs, learned online from the guarded steps the controller observes:

    L ~ a + (m - 1) * s + (n - c) * t * (1 + k * p)

m sequences (d decodes, c prompt chunks), n prompt tokens at mean position p; a: one decode
alone; s: one more sequence of one token; t: one more token of a chunk at position 0; k: what
each position adds to a prompt token's cost, as a share of t. a, s, t: exponentially weighted
averages of the steps that measure each (they follow a device within a few steps); k: a slow
weighted least-squares fit of the law to the chunk steps. Before a decode-only step a = 0 (the
paper's law), and the first one, of d decodes, sets a = L / d; before a prompt token s = t = a
(the prior). docs/controller.md says why each part is there. Units: ms and tokens.
"""
from __future__ import annotations

import numpy as np

CLIP = 3.0  # one sample moves s or t at most this fold: a preempted step is the margin's business
MIN_SHARE = 0.1  # (L - a) is taken as at least this share of L: a noisy base never makes a cost <= 0
DEPTH_KEEP = 1 - 1 / 256  # k is the model's, not the moment's: its fit spans ~256 chunk steps
MIN_SPREAD = 64  # positions: a slope over positions closer than this is noise
MIN_SIZE_SPREAD = 1.0  # tokens: chunks of one size cannot tell a token's cost from the pass's


class StepCostModel:
    def __init__(self, forgetting: float = 0.95):
        self.keep = forgetting  # share of the old estimate an observation keeps
        self.base_ms: float | None = None  # a
        self.seq_ms: float | None = None  # s (None: as t)
        self.token_ms: float | None = None  # t
        self.n_obs = 0
        self.seq_measured_at: int | None = None  # n_obs when s was last measured
        self.depth = 0.0  # k
        self.fitted_seq_ms: float | None = None  # s as the fit sees it: the pass until s is measured
        self._xx = np.zeros((3, 3))  # the fit's weighted sums: x x' and x y over x = (m - 1, n - c, (n - c) p)
        self._xy = np.zeros(3)
        self._spread = np.zeros(5)  # weighted sums of 1, p, p^2, n - c, (n - c)^2

    def update(self, latency_ms: float, n: int, n_decode: int = 1, n_chunks: int | None = None,
               position: float = 0.0) -> None:
        self.n_obs += 1
        c = (1 if n > 0 else 0) if n_chunks is None else min(n_chunks, n)
        extra_seqs = n_decode - 1 + c  # 0 for one chunk with no decode beside it: its first token is the base
        if (n <= 0 and n_decode <= 1) or (self.base_ms is not None and extra_seqs <= 0 and n == c):
            self.base_ms = latency_ms if self.base_ms is None else self._mix(self.base_ms, latency_ms)
            return  # a decode-only step's shape: one sequence with one token
        if self.base_ms is None:  # no base yet: every extra is taken as one token's cost
            if n > 0:
                self.token_ms = self._clipped(self.token_ms, max(latency_ms, 0.0) / n)
            else:  # d decodes alone, none alone before: a at the prior's s = a
                self.base_ms = latency_ms / n_decode
            return
        rest = max(latency_ms - self.base_ms, MIN_SHARE * latency_ms)
        if n == c:  # every extra sequence carries one token: this step measures s
            self.seq_measured_at = self.n_obs
            self.seq_ms = self._clipped(self._learned_pass(), rest / extra_seqs)
            return
        # Before s or t is measured the pass is the prior's (charged at 0, the first chunk's
        # passes would go to its tokens).
        sample = max(rest - extra_seqs * self._pass(), MIN_SHARE * latency_ms) / (n - c)
        self._learn_depth(rest, extra_seqs, n - c, position)
        self.token_ms = self._clipped(self.token_ms, sample / (1 + self.depth * position))

    def _learn_depth(self, rest: float, extra_seqs: int, u: int, p: float) -> None:
        x = np.array([extra_seqs, u, u * p], dtype=float)
        self._xx = DEPTH_KEEP * self._xx + np.outer(x, x)
        self._xy = DEPTH_KEEP * self._xy + x * rest
        self._spread = DEPTH_KEEP * self._spread + (1.0, p, p * p, u, u * u)
        w, sp, spp, su, suu = self._spread
        if spp / w - (sp / w) ** 2 < MIN_SPREAD ** 2 or suu / w - (su / w) ** 2 < MIN_SIZE_SPREAD ** 2:
            return
        try:
            seq, token, token_depth = np.linalg.solve(self._xx, self._xy)
        except np.linalg.LinAlgError:
            return
        if token > 0 and seq > 0:  # a fit so noisy it makes a token or a pass free says nothing of k
            self.depth = max(0.0, float(token_depth / token))  # attention never makes a deeper token cheaper
            self.fitted_seq_ms = float(seq)

    def _learned_pass(self) -> float | None:  # s: as measured, else as fitted, else as t
        return next((v for v in (self.seq_ms, self.fitted_seq_ms, self.token_ms) if v is not None), None)

    def _pass(self) -> float:  # as learned, else the prior (a decode-only step)
        learned = self._learned_pass()
        return (self.base_ms or 0.0) if learned is None else learned

    def _token(self, position: float = 0.0) -> float:  # t at a position: as measured, else as s
        return self._pass() if self.token_ms is None else self.token_ms * (1 + self.depth * position)

    def base(self, n_decode: int = 1) -> float | None:
        """Decode-only step time with `n_decode` decodes (None: none seen yet)."""
        return None if self.base_ms is None else max(0.0, self.base_ms + (n_decode - 1) * self._pass())

    def scale(self, factor: float) -> None:
        """Every cost times `factor` (the device got that much slower, or faster under 1); the rest is kept."""
        self.base_ms, self.seq_ms, self.token_ms = (None if v is None else v * factor
                                                    for v in (self.base_ms, self.seq_ms, self.token_ms))
        self._xy = self._xy * factor  # the fit's costs scale: k, a ratio of two of them, is kept
        self.fitted_seq_ms = None if self.fitted_seq_ms is None else self.fitted_seq_ms * factor

    def _clipped(self, old: float | None, sample: float) -> float:  # sample moved at most CLIP-fold
        return sample if old is None else self._mix(old, min(CLIP * old, max(old / CLIP, sample)))

    def _mix(self, old: float, new: float) -> float:
        return self.keep * old + (1 - self.keep) * new

    @property
    def ready(self) -> bool:  # a prompt token's cost has been measured
        return self.token_ms is not None

    @property
    def plannable(self) -> bool:  # measured, or a decode-only step seen (the prior)
        return self.token_ms is not None or self.base_ms is not None

    def predict(self, n: int, n_decode: int = 1, position: float = 0.0) -> float | None:
        """A step with `n` prompt tokens in one chunk at `position` beside `n_decode` decodes."""
        base = self.base(n_decode)
        if not self.plannable or (n == 0 and base is None):
            return None
        return (base or 0.0) + (self._pass() + (n - 1) * self._token(position) if n > 0 else 0.0)

    def tokens_within(self, budget_ms: float, n_decode: int = 1, position: float = 0.0) -> float:
        """Prompt tokens (one chunk from `position`) that fit a step of `budget_ms` beside
        `n_decode` decodes; below 1 (possibly negative) when not even one does."""
        room, first = budget_ms - (self.base(n_decode) or 0.0), self._pass()
        if room < first:
            return room / max(first, 1e-9)
        return 1.0 + (room - first) / max(self._token(position), 1e-9)
