"""SIMULATED backend: a latency model, for fast deterministic controller studies.

It runs no model. Step time follows a linear cost model (a base, a cost per decode,
per prompt chunk and per prompt token, and attention that grows with depth) and is spent on a virtual
clock (or slept, with `sleep=True`). Its numbers are never a measurement of a
device; every trace it produces says `simulated`.

`replay_noise(steps-*.jsonl)` fits the cost model to a real run's step trace and
keeps each recorded step's ratio to the fit, in recorded order: replayed, the
ratios give the simulated steps the real device's spread and its bursts (another
process taking a core for a while). `cost_factor` multiplies every step (a cost
shift mid-run).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dlfp.protocol import TIMING_SYNC_WALL, Backend, Capabilities, StepPlan, StepResult


@dataclass
class SimCost:
    base_s: float = 0.004  # fixed cost of any step
    decode_s: float = 0.010  # per decoding sequence
    prefill_token_s: float = 0.008  # per prompt token
    chunk_s: float = 0.0  # per prompt chunk: a sequence more in the step (a pass on a CPU)
    attention_s: float = 2e-6  # per prompt token per position already cached (grows with depth)


@dataclass
class ReplayNoise:
    """Per-step cost ratios recorded from a real trace, replayed in order (cyclically)."""

    ratios: list[float]
    source: str = ""
    offset: int = 0  # where replay starts (a study varies it per seed)
    fitted: SimCost = field(default_factory=SimCost)

    def __post_init__(self) -> None:
        if not self.ratios or min(self.ratios) <= 0:
            raise ValueError("replay noise needs positive ratios")

    def at(self, step_index: int) -> float:
        return self.ratios[(self.offset + step_index) % len(self.ratios)]


def replay_noise(path: str | Path, attention_s: float = 0.0) -> ReplayNoise:
    """Fit base + per-decode + per-prompt-chunk + per-prompt-token cost to a recorded
    steps-*.jsonl (a chunk is counted per class that carried prompt tokens: the trace
    does not say how many sequences they came from).

    The trace has no positions, so the fit averages the position cost into the
    per-token cost; `attention_s` (per prompt token per cached position) adds it
    back explicitly, as a stated assumption of the study.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("duration_s", 0) > 0]
    if len(rows) < 16:
        raise ValueError(f"{path}: {len(rows)} timed steps; a replay needs at least 16")
    x = np.array([[1.0, r["n_decode"], r["n_prefill_fg"] + r["n_prefill_bg"],
                   (r["n_prefill_fg"] > 0) + (r["n_prefill_bg"] > 0)] for r in rows])
    y = np.array([r["duration_s"] for r in rows])
    # Relative least squares: the ratios, not seconds, are what gets replayed.
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    coef = np.maximum(coef, 1e-5)
    fit = SimCost(base_s=float(coef[0]), decode_s=float(coef[1]), prefill_token_s=float(coef[2]),
                  chunk_s=float(coef[3]), attention_s=attention_s)
    ratios = (y / (x @ coef)).tolist()
    return ReplayNoise(ratios, source=str(path), fitted=fit)


class VirtualClock:
    """A clock the simulated backend advances; pass `clock.now` to the engine."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class SimBackend(Backend):
    name = "sim"
    simulated = True

    def __init__(
        self,
        cost: SimCost | None = None,
        clock: VirtualClock | None = None,
        vocab_size: int = 1000,
        max_sequences: int = 4,
        context: int = 4096,
        max_batch_tokens: int = 512,
        multi_sequence: bool = True,
        sleep: bool = False,
        eos_id: int | None = None,
        noise: ReplayNoise | None = None,
        prefix_reuse: bool = False,
    ):
        self.cost = cost or (noise.fitted if noise is not None else SimCost())
        self.noise = noise
        self.cost_factor = 1.0  # a study or test shifts the cost mid-run by changing it
        self.steps_run = 0
        self.clock = clock
        self.sleep = sleep
        self.eos_id = eos_id
        self.capabilities = Capabilities(
            owned_loop=True,
            multi_sequence=multi_sequence,
            per_step_chunking=True,
            timing=TIMING_SYNC_WALL,
            max_sequences=max_sequences,
            context_per_sequence=context,
            max_batch_tokens=max_batch_tokens,
            vocab_size=vocab_size,
            prefix_reuse=prefix_reuse,
            cut_steps=True,
        )
        self.history: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []
        self._cut, self._cut_lock, self._cuttable = threading.Event(), threading.Lock(), False

    def duration(self, plan: StepPlan) -> float:
        """The model's step time, times the cost factor and the replayed noise of this step."""
        c = self.cost
        attention = sum(len(p.token_ids) * (p.start + len(p.token_ids) / 2) for p in plan.prefills)
        d = (c.base_s + c.decode_s * plan.n_decode + c.chunk_s * len(plan.prefills)
             + c.prefill_token_s * plan.n_prefill + c.attention_s * attention)
        noise = self.noise.at(self.steps_run) if self.noise is not None else 1.0
        return d * self.cost_factor * noise

    def time_step(self, plan: StepPlan) -> float:
        """Duration of the next step (the replay moves on by one step)."""
        d = self.duration(plan)
        self.steps_run += 1
        return d

    def step_within(self, plan: StepPlan, limit_s: float | None) -> StepResult:
        """A step whose modelled time exceeds `limit_s` is cut there: the time passes, nothing
        is computed (the replay moves on by one step, as a device's slow moment would). A
        sleeping simulation's step is also cut by `cut_step`: its sleep ends then."""
        d = self.duration(plan)
        self.steps_run += 1
        ran = self._pass(d if limit_s is None else min(d, max(0.0, limit_s)), cuttable=True)
        if ran < d:
            return StepResult(logits={}, duration_s=ran, cut=True)
        return self._compute(plan, d)

    def cut_step(self) -> None:
        with self._cut_lock:
            if self._cuttable:
                self._cut.set()

    def _pass(self, d: float, cuttable: bool = False) -> float:
        """Spend `d` of the clock; returns what was spent (less where `cut_step` ended a sleep)."""
        if self.clock is not None:
            self.clock.t += d
        elif self.sleep and cuttable:
            with self._cut_lock:
                self._cuttable = True
                self._cut.clear()
            t0 = time.perf_counter()
            cut = self._cut.wait(d)
            with self._cut_lock:
                self._cuttable = False
            return time.perf_counter() - t0 if cut else d
        elif self.sleep:
            time.sleep(d)
        return d

    def step(self, plan: StepPlan) -> StepResult:
        d = self.time_step(plan)
        self._pass(d)
        return self._compute(plan, d)

    def _compute(self, plan: StepPlan, d: float) -> StepResult:
        self.plans.append(plan)
        logits = {}
        for item in plan.decodes:
            self.history.setdefault(item.seq_id, []).append(item.token_id)
            logits[item.seq_id] = self._logits(item.seq_id)
        for chunk in plan.prefills:
            self.history.setdefault(chunk.seq_id, []).extend(chunk.token_ids)
            if chunk.wants_logits:
                logits[chunk.seq_id] = self._logits(chunk.seq_id)
        return StepResult(logits=logits, duration_s=d)

    def _logits(self, seq_id: int) -> np.ndarray:
        # A deterministic function of the sequence so far: batch-independent by construction.
        h = self.history[seq_id]
        row = np.zeros(self.capabilities.vocab_size, dtype=np.float32)
        row[(sum(h) * 31 + len(h)) % self.capabilities.vocab_size] = 1.0
        return row

    def free_sequence(self, seq_id: int) -> None:
        self.history.pop(seq_id, None)

    def keep_prefix(self, seq_id: int, n_tokens: int) -> bool:
        """The slot's history up to `n_tokens` stays (its logits depend on it, as KV would)."""
        self.history[seq_id] = self.history.get(seq_id, [])[:n_tokens]
        return True

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [b % self.capabilities.vocab_size for b in text.encode()]

    def detokenize(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))

    def is_eos(self, token_id: int) -> bool:
        return token_id == self.eos_id

    def describe(self) -> dict:
        out = {"name": self.name, "simulated": True, "cost": vars(self.cost), "cost_factor": self.cost_factor}
        if self.noise is not None:
            out["replayed_noise"] = {"source": self.noise.source, "steps": len(self.noise.ratios)}
        return out


def from_profile(model_path: str | None, profile, **_) -> SimBackend:
    """The target registry's loader: a SIMULATED backend sized like the profile, sleeping
    in real time (labelled simulated in every trace). It runs no model: `model_path` is ignored."""
    lim = profile.limits
    return SimBackend(max_sequences=lim.max_sequences, context=lim.context_per_sequence,
                      max_batch_tokens=lim.max_batch_tokens, sleep=True)
