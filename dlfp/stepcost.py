"""What a step costs, learned online from the guarded steps the controller observes.

    L ~ a + (m - 1) * s + (n - c) * t

m sequences in the step (d decodes and c prompt chunks), n prompt tokens. a: a
step with one decode and nothing else. s: one more sequence carrying one token
(a second decode, or a prompt chunk's first token). t: one more token in a
sequence that already has one. On a small CPU a step pays about a whole pass
per sequence and much less per further token of a chunk, so s ~ 2t there; one
cost per token (s = t) fitted to one-token chunks overpredicts larger chunks,
and fitted to larger chunks it underpredicts one-token ones. On a GPU s ~ t ~ 0:
the same model, other numbers.

Each parameter is an exponentially weighted average of what the steps that
measure it directly say, given the others: a from decode-only steps with one
decode; s from steps whose extra sequences carry one token each (decode-only
steps with more decodes, one-token chunks); t from steps with longer chunks.
Each follows the prompt's position (a token deep in a long document attends over
more cells) and a slower device within a few steps. Until s is measured it is
taken to equal t (the per-token law). A full least-squares fit of such terms
swung wildly whenever the cap sat still (they are then not separately
identifiable); here a parameter that the steps stop measuring just keeps its
last value, and the one that is measured absorbs the difference at the cap in
use. One sample may move s or t by at most a factor of 3: a single preempted
step is the spread's business (the quantile setpoint), not the cost's. Until a
decode-only step is seen, a is 0 and t is L / n: the paper's proportional law.

Before any prompt token is measured, predictions take a pass and a token to cost
a decode-only step each (s = t = a: about the dearest a token costs on a CPU; on
a GPU far above it, so the first guarded chunk errs small rather than running
the profile's `initial` cap blind). Units: milliseconds and tokens.
"""
from __future__ import annotations

CLIP = 3.0  # one sample moves s or t toward at most CLIP times (or 1/CLIP of) its current value
MIN_SHARE = 0.1  # (L - a) is taken as at least this share of L: a noisy base never makes a cost <= 0


class StepCostModel:
    def __init__(self, forgetting: float = 0.95):
        self.keep = forgetting  # share of the old estimate an observation keeps
        self.base_ms: float | None = None  # a: decode-only step time with one decode
        self.seq_ms: float | None = None  # s: one more sequence with one token (None: as t)
        self.token_ms: float | None = None  # t: one more token in a sequence
        self.n_obs = 0
        self.seq_measured_at: int | None = None  # n_obs when s was last measured
        self.decodes = 1  # the decode count of the latest step: the default for predictions

    def update(self, latency_ms: float, n: int, n_decode: int | None = None, n_chunks: int | None = None) -> None:
        self.n_obs += 1
        d = self.decodes = self.decodes if n_decode is None else n_decode
        c = (1 if n > 0 else 0) if n_chunks is None else min(n_chunks, n)
        if n <= 0 and d <= 1:
            self.base_ms = latency_ms if self.base_ms is None else self._mix(self.base_ms, latency_ms)
            return
        if self.base_ms is None:  # no base yet: every extra is taken as one token's cost
            if n > 0:
                self.token_ms = self._clipped(self.token_ms, max(latency_ms, 0.0) / n)
            return
        extra_seqs = d - 1 + c  # 0 for one chunk with no decode beside it: its first token is the base
        if extra_seqs <= 0 and n == c:  # one sequence with one token: a decode-only step's shape
            self.base_ms = self._mix(self.base_ms, latency_ms)
            return
        rest = max(latency_ms - self.base_ms, MIN_SHARE * latency_ms)
        if n == c:  # every extra sequence carries one token: this step measures s
            self.seq_measured_at = self.n_obs
            self.seq_ms = self._clipped(self.seq_ms if self.seq_ms is not None else self.token_ms,
                                        rest / extra_seqs)
            return
        # Before s or t is measured the pass is the prior's (a decode-only step): charged at 0,
        # the first chunk's passes went to its tokens (a 2-token chunk taught t = 34 ms, s ~ 16).
        sample = max(rest - extra_seqs * self._pass(), MIN_SHARE * latency_ms) / (n - c)
        self.token_ms = self._clipped(self.token_ms, sample)

    def seq(self) -> float:
        """s as measured, as t until measured (0 before anything is): what updates use."""
        if self.seq_ms is not None:
            return self.seq_ms
        return self.token_ms or 0.0

    def seq_age(self) -> int | None:
        """Observations since s was last measured (None: never)."""
        return None if self.seq_measured_at is None else self.n_obs - self.seq_measured_at

    def _pass(self) -> float:
        """s for predictions: as measured, else the prior (a decode-only step)."""
        if self.seq_ms is None and self.token_ms is None:
            return self.base_ms or 0.0
        return self.seq()

    def _token(self) -> float:
        """t for predictions: as measured, else as s."""
        return self._pass() if self.token_ms is None else self.token_ms

    def base(self, n_decode: int | None = None) -> float | None:
        """Decode-only step time with `n_decode` decodes (None: none seen yet)."""
        d = self.decodes if n_decode is None else n_decode
        if self.base_ms is None:
            return None
        return max(0.0, self.base_ms + (d - 1) * self._pass())

    def scale(self, factor: float) -> None:
        """Every cost times `factor` (the device got that much slower); the rest is kept."""
        for name in ("base_ms", "seq_ms", "token_ms"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name) * factor)

    def _clipped(self, old: float | None, sample: float) -> float:
        if old is None:
            return sample
        return self._mix(old, min(CLIP * old, max(old / CLIP, sample)))

    def _mix(self, old: float, new: float) -> float:
        return self.keep * old + (1 - self.keep) * new

    @property
    def ready(self) -> bool:
        """A prompt token's cost has been measured."""
        return self.token_ms is not None

    @property
    def plannable(self) -> bool:
        """Measured, or a decode-only step seen (the prior)."""
        return self.token_ms is not None or self.base_ms is not None

    def predict(self, n: int, n_decode: int | None = None) -> float | None:
        """A step with `n` prompt tokens in one chunk beside `n_decode` decodes."""
        base = self.base(n_decode)
        if not self.plannable or (n == 0 and base is None):
            return None
        return (base or 0.0) + (self._pass() + (n - 1) * self._token() if n > 0 else 0.0)

    def tokens_within(self, budget_ms: float) -> float:
        """How many prompt tokens (one chunk) fit in a step of `budget_ms` beside `decodes`
        decodes; below 1 (possibly negative) when not even one does."""
        assert self.plannable, "no guarded step observed yet"
        room = budget_ms - (self.base() or 0.0)
        first = self._pass()
        if room < first:
            return room / max(first, 1e-9)
        return 1.0 + (room - first) / max(self._token(), 1e-9)
