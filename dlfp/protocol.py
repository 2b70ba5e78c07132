"""The backend protocol: what crosses from the engine to a runtime and back.

A step is one synchronous iteration of the model over a mixed batch: one token for
every decoding sequence plus zero or more prefill chunks. The backend returns the
logits the plan asked for and how long the *completed* work took. The core never
imports an adapter; an adapter imports only this module.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

# How an adapter knows its step has finished on the device.
TIMING_SYNC_WALL = "synchronous-wall"  # the call returns when the work is done (CPU)
TIMING_OUTPUT_READY = "output-ready"  # copying the outputs to the host forces completion
TIMING_DEVICE_EVENT = "device-event"  # device events/callbacks bracket the work

# Pipelined backends only: a decode's token id meaning "the token this slot's previous
# step sampled on the device", so step k+1 can be launched before step k's tokens
# reach the host (vLLM's async scheduling).
PLACEHOLDER_TOKEN = -1


class BackendError(Exception):
    """A request-level failure the engine records in the trace (the run goes on)."""


class ModelLoadError(ValueError):
    """The model is missing, of the wrong kind, or the runtime refused it (one line for the user)."""


@dataclass(frozen=True)
class Limits:
    """How much a backend holds, in the one set of names every adapter uses.

    A device profile gives the wanted limits; an adapter may lower them to what its
    model or runtime allows and reports the result in its Capabilities.
    """

    max_sequences: int  # sequences alive at once (llama.cpp's n_seq_max)
    context_per_sequence: int  # positions one sequence may occupy (vLLM's max_model_len)
    max_batch_tokens: int  # tokens one step may carry (llama.cpp's n_batch, MLC's prefill_chunk_size)

    def __post_init__(self) -> None:
        for name in ("max_sequences", "context_per_sequence", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def physical_cores() -> int:
    """Threads for a CPU runtime: one per physical core (oversubscribing 2 cores turned a
    1 ms decode into 400 ms with llama.cpp; XNNPACK and TVM pools contend the same way)."""
    import psutil

    return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)


@dataclass(frozen=True)
class Capabilities:
    owned_loop: bool  # the engine drives each step (False: the runtime schedules itself)
    multi_sequence: bool  # several sequences can share one step
    per_step_chunking: bool  # the prompt tokens of each step can be chosen per step
    timing: str  # one of the TIMING_* kinds
    max_sequences: int  # sequences alive at once
    context_per_sequence: int  # positions one sequence may occupy
    max_batch_tokens: int  # tokens one step may carry (llama.cpp's n_batch)
    vocab_size: int
    # A slot's cache can keep its first n positions and drop the rest (`Backend.keep_prefix`),
    # so a request that shares a prompt prefix with a slot's last one prefills only the rest.
    prefix_reuse: bool = False
    # A step still running at a deadline, or when asked from another thread, can be cut
    # (`Backend.step_within`, `Backend.cut_step`), every cache left as it was before the step:
    # a guarded step a slowdown caught mid-way then costs its decodes' ITL the deadline plus
    # a decode, not the whole slowed step, and a new turn does not wait for a background one.
    cut_steps: bool = False

    def limits(self) -> Limits:
        return Limits(self.max_sequences, self.context_per_sequence, self.max_batch_tokens)


@dataclass
class DecodeItem:
    seq_id: int
    token_id: int  # the last sampled token, fed back in
    position: int


@dataclass
class PrefillChunk:
    seq_id: int
    token_ids: list[int]
    start: int  # position of the first token of the chunk
    wants_logits: bool  # the chunk ends the prompt: sample the first output token

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class StepPlan:
    decodes: list[DecodeItem] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def n_decode(self) -> int:
        return len(self.decodes)

    @property
    def n_prefill(self) -> int:
        return sum(len(c.token_ids) for c in self.prefills)

    @property
    def n_tokens(self) -> int:
        return self.n_decode + self.n_prefill

    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


def validate_plan(plan: StepPlan, caps: "Capabilities", placeholders: bool = False) -> None:
    """Refuse a plan no adapter can run, before it reaches the runtime.

    Runtimes answer a bad batch badly (llama.cpp asserts and kills the process on a
    batch over n_batch; TVM raises mid-step with the cache half written), so every
    adapter calls this first and adds only the checks its runtime needs beyond it.
    """
    if plan.is_empty():
        raise BackendError("empty step plan")
    if plan.n_tokens > caps.max_batch_tokens:
        raise BackendError(f"step of {plan.n_tokens} tokens exceeds max_batch_tokens={caps.max_batch_tokens}")
    slots = [d.seq_id for d in plan.decodes] + [c.seq_id for c in plan.prefills]
    if len(set(slots)) != len(slots):
        raise BackendError(f"a sequence appears twice in one step: {slots}")
    if len(slots) > 1 and not caps.multi_sequence:
        raise BackendError("this backend runs one sequence per step (multi_sequence=False)")
    for slot in slots:
        if not 0 <= slot < caps.max_sequences:
            raise BackendError(f"sequence slot {slot} is outside 0..{caps.max_sequences - 1}")
    for c in plan.prefills:
        if not c.token_ids:
            raise BackendError(f"empty prefill chunk for sequence {c.seq_id}")
        if c.start < 0 or c.end > caps.context_per_sequence:
            raise BackendError(f"sequence {c.seq_id} would pass the context of {caps.context_per_sequence}")
    for d in plan.decodes:
        if not 0 <= d.position < caps.context_per_sequence:
            raise BackendError(f"sequence {d.seq_id} is at the end of its context")
    tokens = [d.token_id for d in plan.decodes if not (placeholders and d.token_id == PLACEHOLDER_TOKEN)]
    tokens += [t for c in plan.prefills for t in c.token_ids]
    bad = next((t for t in tokens if not 0 <= t < caps.vocab_size), None)
    if bad is not None:
        raise BackendError(f"token id {bad} is outside the vocabulary (size {caps.vocab_size})")


@dataclass
class StepResult:
    logits: dict[int, np.ndarray]  # seq_id -> next-token logits (float32, vocab)
    duration_s: float  # completed work, as the adapter's timing kind measures it
    device_duration_s: float | None = None  # a device-side figure where one exists (ETDump, events)
    # Optional: the greedy token of each logits row, sampled on the device (the torch backend).
    # Adapters that sample nowhere leave it None; the engine samples from `logits`.
    # Required from a pipelined backend (the next step has already consumed these tokens).
    token_ids: dict[int, int] | None = None
    # The step was cut at its deadline (`Backend.step_within`): no logits, no cache change;
    # duration_s is how long it ran.
    cut: bool = False


class PendingStep(ABC):
    """A launched step (`Backend.launch`): `wait()` blocks until its results are host memory."""

    @abstractmethod
    def wait(self) -> StepResult: ...


class DoneStep(PendingStep):
    """A step that ran synchronously in `launch` (the default for every backend)."""

    def __init__(self, result: StepResult):
        self.result = result

    def wait(self) -> StepResult:
        return self.result


class Backend(ABC):
    """One runtime behind the engine. Methods are called from the engine thread only."""

    name: str = "backend"
    capabilities: Capabilities

    @abstractmethod
    def free_sequence(self, seq_id: int) -> None:
        """Empty slot `seq_id` (0 <= seq_id < max_sequences) and its cache for reuse.

        The scheduler owns slot numbering; a slot is always freed before it is reused.
        """

    def keep_prefix(self, seq_id: int, n_tokens: int) -> bool:
        """Keep positions 0..n_tokens-1 of slot `seq_id`'s cache, drop the rest.

        Called only when `capabilities.prefix_reuse` is declared, on a free slot
        before a new sequence starts in it. False: the runtime could not (the
        engine then frees the slot and prefills the whole prompt).
        """
        return False

    @abstractmethod
    def step(self, plan: StepPlan) -> StepResult:
        """Run one iteration synchronously and return once the work has completed."""

    def step_within(self, plan: StepPlan, limit_s: float | None) -> StepResult:
        """`step`, cut if it is still running `limit_s` after it started (None: no deadline)
        or once `cut_step` is called: then a result with `cut` set, no logits, and every cache
        as before the step. Only called where `capabilities.cut_steps` is declared; the
        default runs the step whole."""
        return self.step(plan)

    def cut_step(self) -> None:
        """Cut the step running now under `step_within`, from any thread (a foreground prompt
        arrived behind a background step); nothing where no such step runs. Declared with
        `capabilities.cut_steps`."""

    # Pipelined (async) mode: the engine launches step k+1 before it waits for step k.
    # A backend that sets `pipelined = True` must queue work in `launch` without waiting
    # for earlier steps, accept PLACEHOLDER_TOKEN in decodes, and return greedy
    # `token_ids` from every step. The engine then samples greedily on the device only.
    pipelined: bool = False

    def launch(self, plan: StepPlan) -> PendingStep:
        """Start a step and return its handle. Default: run it synchronously now."""
        return DoneStep(self.step(plan))

    @abstractmethod
    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    @abstractmethod
    def detokenize(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_ids: list[int]) -> bytes | None:
        """Raw bytes of tokens, so a stream can hold back a split UTF-8 character.

        None (the default): the tokenizer has no byte pieces to give (decoding one
        token alone may drop its leading space), so a stream decodes the whole
        output and hands out the new suffix instead.
        """
        return None

    @abstractmethod
    def is_eos(self, token_id: int) -> bool: ...

    def max_token_bytes(self) -> int | None:
        """The most input bytes one token can cover, so a server can refuse text that
        cannot fit the context before tokenising it. None: no sound bound is known."""
        return None

    # Threads: a CPU runtime whose step threads wait on each other at every op loses
    # most of a step to one busy neighbour; running on fewer threads avoids that.
    threads: int | None = None  # threads a step uses now (None: not under our control)
    max_threads: int | None = None  # what it was loaded with: set_threads never goes above

    def set_threads(self, n: int) -> bool:
        """Run the following steps on n threads (1 <= n <= max_threads). False: the runtime cannot."""
        return False

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt, rendered with the model's own template."""
        raise BackendError(f"backend {self.name} has no chat template")

    def describe(self) -> dict:
        """What the trace records about this backend (model path, threads, versions)."""
        return {"name": self.name}

    def close(self) -> None:
        pass

    def __del__(self):
        try:
            self.close()  # a runtime holds native memory (contexts, worker processes)
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn modules down
            pass
