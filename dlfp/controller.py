"""Prefill-cap policies: how many prompt tokens may join a step that also decodes.

Pure and clock-free: a policy is told what was observed and answers with a cap.
The engine decides *what* it observes (completed step time or the scheduler-call
interval); the policy records which source it was built for so traces say so.

DLFP is equation (2) of the paper:

    c_next = clamp(floor_q(c * T / L), c_min, c_max)
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields, replace
from typing import Mapping

COMPLETION = "completion"  # completed device time of the step (what dlfp uses)
CADENCE = "cadence"  # interval between scheduler calls (the paper's proxy; reproduction only)
SOURCES = (COMPLETION, CADENCE)

# Consecutive observations at the minimum cap that still miss the target before
# the controller declares the target unreachable.
UNREACHABLE_AFTER = 8


@dataclass(frozen=True)
class StepShape:
    """What an observed step carried, for policies that learn the step's cost.

    Positions are context positions (0-based): a prompt token deep in a long
    document attends over more cells than one near its start, so its cost grows
    with position.
    """

    n_decode: int = 0  # decode tokens (one per decoding sequence)
    n_prefill: int = 0  # prompt tokens of all chunks together
    prefill_position_sum: int = 0  # sum over prompt tokens of their positions
    decode_position_sum: int = 0  # sum over decode tokens of their positions

    @property
    def mean_prefill_position(self) -> float:
        return self.prefill_position_sum / self.n_prefill if self.n_prefill else 0.0


class PrefillPolicy(ABC):
    """Caps the prompt tokens of a step that overlaps an active decode ("guarded").

    Contract: `cap()` is asked once per guarded step; `observe()` gets the latency
    of each guarded step that ran; `reset()` is called when nothing decodes, so an
    isolated prefill is never capped by the policy.
    """

    name: str = "policy"
    source: str = COMPLETION

    @abstractmethod
    def cap(self) -> int | None:
        """Prompt-token cap for the next guarded step; None means no cap."""

    def observe(self, latency_s: float, cap: int | None = None, shape: StepShape | None = None) -> None:
        """Latency of a guarded step that has completed.

        `cap` is the cap that step was planned with, when the caller knows it and
        it may differ from the current one (a pipelined engine such as vLLM's async
        scheduling plans the next step before this one completes). `shape` says
        what the step carried, where the caller knows it.
        """

    def reset(self) -> None:
        """Nothing decodes any more: forget the interference state."""

    @property
    def target_unreachable(self) -> bool:
        return False

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source}


class Unbounded(PrefillPolicy):
    """No cap: the whole pending prompt (up to the batch size) joins the step."""

    name = "unbounded"

    def cap(self) -> int | None:
        return None


class FixedCap(PrefillPolicy):
    """A static cap: the classic fixed chunked-prefill baseline."""

    def __init__(self, tokens: int):
        if tokens < 1:
            raise ValueError(f"fixed cap must be >= 1 token, got {tokens}")
        self.tokens = tokens
        self.name = f"fixed:{tokens}"

    def cap(self) -> int | None:
        return self.tokens

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "tokens": self.tokens}


@dataclass(frozen=True)
class DLFPParams:
    target_s: float
    initial: int
    minimum: int
    maximum: int
    quantum: int = 1
    # Largest factor the cap may grow by in one observation (None: unlimited, the
    # paper's law). Shrinking is never limited. On a noisy CPU one lucky fast step
    # would otherwise multiply the cap and the next step overshoots the target.
    max_growth: float | None = None

    def __post_init__(self) -> None:
        if self.max_growth is not None and self.max_growth <= 1:
            raise ValueError(f"max_growth must be > 1, got {self.max_growth}")
        if self.target_s <= 0:
            raise ValueError(f"target must be positive, got {self.target_s}")
        if self.quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {self.quantum}")
        if not 1 <= self.minimum <= self.initial <= self.maximum:
            raise ValueError(
                f"need 1 <= minimum <= initial <= maximum, got "
                f"{self.minimum}, {self.initial}, {self.maximum}"
            )


def params_to_dict(p: DLFPParams) -> dict:
    """Every field of the parameters, the target in ms: what traces, configs and the
    vLLM plug-in's settings carry. Serialised from the dataclass, so none is dropped."""
    d = asdict(p)
    return {"target_ms": d.pop("target_s") * 1e3, **d}


def params_from_dict(values: Mapping, base: DLFPParams) -> DLFPParams:
    """`base` with the fields `values` names (as params_to_dict spells them) replaced.

    Values may be strings (environment variables); each is converted to the type of
    the field's value in `base`. Raises ValueError naming an unknown or bad key.
    """
    names = {f.name for f in fields(DLFPParams)}
    changes = {}
    for key, raw in values.items():
        name = "target_s" if key == "target_ms" else key
        if key == "target_s" or name not in names:
            raise ValueError(f"unknown controller parameter {key!r}; known: {', '.join(params_to_dict(base))}")
        current = getattr(base, name)
        try:
            if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none")):
                value = None
            elif isinstance(current, bool):
                value = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
            elif isinstance(current, int):
                value = int(raw)
            else:
                value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"controller parameter {key!r}: not a number: {raw!r}") from None
        changes[name] = value / 1e3 if key == "target_ms" and value is not None else value
    return replace(base, **changes)


def next_cap(cap: int, target_s: float, latency_s: float, p: DLFPParams) -> int:
    """Equation (2): proportional resize, floored to the quantum, then clamped."""
    if latency_s <= 0:
        return cap  # a zero-length observation carries no information
    scaled = cap * target_s / latency_s
    if p.max_growth is not None:
        scaled = min(scaled, max(cap * p.max_growth, cap + p.quantum))  # always room for one quantum
    # Round before flooring so 3072*80/57.51 style products are not lost to float noise.
    floored = math.floor(round(scaled, 6) / p.quantum) * p.quantum
    return max(p.minimum, min(p.maximum, floored))


class DLFP(PrefillPolicy):
    """Decode-Latency Feedback Prefill."""

    def __init__(self, params: DLFPParams, source: str = COMPLETION):
        if source not in SOURCES:
            raise ValueError(f"unknown observation source {source!r}; one of {SOURCES}")
        self.params = params
        self.source = source
        self.name = "dlfp" if source == COMPLETION else "dlfp-cadence"
        self._cap = params.initial
        self._misses_at_min = 0

    def cap(self) -> int | None:
        return self._cap

    def observe(self, latency_s: float, cap: int | None = None, shape: StepShape | None = None) -> None:
        p = self.params
        # Scale the cap the observed step ran with: scaling a cap that a later
        # observation already moved would apply one correction twice.
        base = self._cap if cap is None else cap
        at_min = base == p.minimum
        self._cap = next_cap(base, p.target_s, latency_s, p)
        # A miss at the minimum means even the smallest chunk cannot meet the
        # target (often: the decode alone is slower than the target).
        self._misses_at_min = self._misses_at_min + 1 if at_min and latency_s > p.target_s else 0

    def reset(self) -> None:
        self._cap = self.params.initial
        # Unreachability is a property of the device, not of one burst: keep the count.

    @property
    def target_unreachable(self) -> bool:
        return self._misses_at_min >= UNREACHABLE_AFTER

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, **params_to_dict(self.params)}


def make_budget_policy(budget_s: float, initial: int, max_tokens: int) -> PrefillPolicy:
    """Sizes isolated background chunks so that one step stays within the preemption
    budget: the same proportional law, aimed at the budget instead of the ITL target."""
    initial = max(1, min(initial, max_tokens))
    return DLFP(DLFPParams(budget_s, initial, 1, max_tokens, 1))


def parse_policy(spec: str, defaults: DLFPParams) -> PrefillPolicy:
    """`unbounded`, `fixed:N`, `dlfp`, `dlfp-cadence` -> a fresh policy."""
    spec = spec.strip()
    if spec == "unbounded":
        return Unbounded()
    if spec.startswith("fixed:"):
        value = spec.split(":", 1)[1]
        if not value.isdigit():
            raise ValueError(f"fixed cap needs a positive integer: {spec!r}")
        return FixedCap(int(value))
    if spec == "dlfp":
        return DLFP(defaults, COMPLETION)
    if spec == "dlfp-cadence":
        return DLFP(defaults, CADENCE)
    raise ValueError(f"unknown policy {spec!r}: use unbounded, fixed:N, dlfp or dlfp-cadence")
