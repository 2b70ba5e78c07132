"""A request as submitted, and its sequence as the scheduler tracks it."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field



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


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy, so outputs compare exactly across policies
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


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

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"

    def validate(self, vocab_size: int, context: int) -> None:
        """Raise ValueError with a message a user can act on."""
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {[str(p) for p in PRIORITIES]}, got {self.priority!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(self.prompt_ids) >= context:
            raise ValueError(
                f"prompt of {len(self.prompt_ids)} tokens does not fit the context of "
                f"{context} tokens per sequence"
            )
        bad = next((t for t in self.prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")


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
    n_prefill_chunks: int = 0
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    finished_s: float | None = None

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
