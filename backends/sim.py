"""SIMULATED backend: a latency model, for fast deterministic controller studies.

It runs no model. Step time follows a linear cost model and is spent on a virtual
clock (or slept, with `sleep=True`). Its numbers are never a measurement of a
device; every trace it produces says `simulated`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dlfp.backends.protocol import TIMING_SYNC_WALL, Backend, Capabilities, StepPlan, StepResult


@dataclass
class SimCost:
    base_s: float = 0.004  # fixed cost of any step
    decode_s: float = 0.010  # per decoding sequence
    prefill_token_s: float = 0.008  # per prompt token
    attention_s: float = 2e-6  # per prompt token per position already cached (grows with depth)


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
    ):
        self.cost = cost or SimCost()
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
        )
        self.history: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []

    def duration(self, plan: StepPlan) -> float:
        c = self.cost
        attention = sum(len(p.token_ids) * (p.start + len(p.token_ids) / 2) for p in plan.prefills)
        return c.base_s + c.decode_s * plan.n_decode + c.prefill_token_s * plan.n_prefill + c.attention_s * attention

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        d = self.duration(plan)
        if self.clock is not None:
            self.clock.t += d
        elif self.sleep:
            time.sleep(d)
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

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [b % self.capabilities.vocab_size for b in text.encode()]

    def detokenize(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))

    def is_eos(self, token_id: int) -> bool:
        return token_id == self.eos_id

    def describe(self) -> dict:
        return {"name": self.name, "simulated": True, "cost": vars(self.cost)}


def from_profile(model_path: str | None, profile, **_) -> SimBackend:
    """The target registry's loader: a SIMULATED backend sized like the profile, sleeping
    in real time (labelled simulated in every trace). It runs no model: `model_path` is ignored."""
    lim = profile.limits
    return SimBackend(max_sequences=lim.max_sequences, context=lim.context_per_sequence,
                      max_batch_tokens=lim.max_batch_tokens, sleep=True)
