"""A request as submitted, and its sequence as the scheduler tracks it."""
from __future__ import annotations

import enum
import itertools
import math
import numbers
from dataclasses import dataclass, field

from dlfp.metrics import ITL_GOAL_PERCENTILE


class Priority(enum.StrEnum):
    """A request's class. Strings on the wire and in traces ("foreground"), enums in code."""

    FOREGROUND = "foreground"  # a person waits on every token: its decodes are guarded
    BACKGROUND = "background"  # throughput work: its prefill yields to the foreground


class FinishReason(enum.StrEnum):
    """Why a request ended, as OpenAI's API and the trace spell it."""

    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # cancelled by the caller, a disconnect or a shutdown
    ERROR = "error"  # refused or failed; the record carries the message


FOREGROUND = Priority.FOREGROUND
BACKGROUND = Priority.BACKGROUND
PRIORITIES = tuple(Priority)

_ids = itertools.count()


SEED_SPACE = 2**64  # generator seeds are taken modulo this: any integer maps to one, deterministically


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy, so outputs compare exactly across policies
    top_p: float = 1.0
    seed: int | None = None  # any integer (OpenAI allows negative seeds); stored as seed mod 2**64

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            # numpy's generators take only non-negative seeds: -1 becomes 2**64 - 1, as two's complement reads it.
            object.__setattr__(self, "seed", int(self.seed) % SEED_SPACE)


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    priority: str = FOREGROUND
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False  # benchmarks force the output length for exact accounting
    request_id: str = ""
    tag: str = ""  # free-form label carried into the trace (turn number, document name)
    cache_prompt: bool = True  # may start from a slot's cached prefix (llama.cpp's field; False: cold prefill)
    # A foreground request's own goals (None: the engine's defaults). Background work has none.
    itl_target_s: float | None = None  # the controller holds the tightest streaming request's target
    ttft_goal_s: float | None = None  # its prompt's deadline is arrival + this; prompts load earliest deadline first

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"

    def validate(self, vocab_size: int, context: int) -> None:
        """Raise ValueError with a message a user can act on."""
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.request_id, str) or not isinstance(self.tag, str):
            raise ValueError("request_id and tag must be strings")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {[str(p) for p in PRIORITIES]}, got {self.priority!r}")
        for name in ("itl_target_s", "ttft_goal_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
            if self.priority != FOREGROUND:
                raise ValueError(f"{name} is a foreground request's goal; a {self.priority} request has none")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(self.prompt_ids) >= context:
            raise ValueError(
                f"prompt of {len(self.prompt_ids)} tokens does not fit the context of "
                f"{context} tokens per sequence"
            )
        bad = next((t for t in self.prompt_ids if not _is_index(t) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary (0 to {vocab_size - 1})")


def _is_index(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Status(enum.Enum):
    WAITING = "waiting"  # no slot yet
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    arrival_s: float
    slot: int | None = None
    status: Status = Status.WAITING
    n_prefilled: int = 0
    n_cached: int = 0  # prompt tokens reused from the slot's cache at admission (never prefilled here)
    preemptions: int = 0  # times it gave its slot back to a conversation and started over
    n_prefill_chunks: int = 0
    in_flight: int = 0  # tokens of launched steps not yet back (pipelined engines)
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    finished_s: float | None = None
    # (bound, gaps over it, token times read): asked every guarded step, so counted as tokens come
    _over: tuple[float, int, int] = field(default=(0.0, 0, 1), repr=False, compare=False)

    def itls_over(self, bound_s: float) -> int:
        """The reply's inter-token gaps so far longer than `bound_s`."""
        bound, count, seen = self._over if self._over[0] == bound_s else (bound_s, 0, 1)
        t = self.token_times
        count += sum(1 for i in range(seen, len(t)) if t[i] - t[i - 1] > bound_s)
        self._over = (bound_s, count, max(seen, len(t)))
        return count

    def excursions_absorbed(self) -> int:
        """ITLs over the target that the reply's own P99, as its goal is judged
        (`dlfp.metrics.missed_goals`, over its max_tokens - 1 gaps), can leave above it: 1 for
        64 tokens, 2 for 200."""
        gaps = self.request.max_tokens - 1
        return max(0, gaps - 1 - math.floor(ITL_GOAL_PERCENTILE / 100 * (gaps - 1)))

    @property
    def priority(self) -> str:
        return self.request.priority

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.n_prefilled

    @property
    def next_position(self) -> int:
        """Position of the token the next decode feeds in (the last sampled one)."""
        return self.prompt_len + len(self.output_ids) - 1
