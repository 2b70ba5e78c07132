"""The torch backend: dlfp's owned loop over a PyTorch decoder on a GPU (or the CPU, in CI).

One step = one forward over every decode and prompt chunk of the plan (see model.py).
Timing, per the porting guide: `duration_s` is the step's own completed time, on the
device's clock, in both modes.
- CUDA: the elapsed time between two events on the step's stream, the start recorded
  before the step's inputs are copied over, the end after its results are copied back.
  When steps are pipelined the start event completes only once the previous step's
  work is done (stream order), so the figure never counts the previous step, nor the
  host's later launch of the next one (which a host clock read at collection would).
  `device_duration_s` is the same figure.
- CPU: one worker thread stands for the device's stream: it runs launched steps one
  after another, in launch order, and times each from when it starts it to when its
  results are ready. `launch` returns once the step is queued, as on a GPU, so the
  next step's work never delays this step's results or counts in its time.
  `device_duration_s` is None.

Sampling on the device: every step also returns the greedy token of each row it
computed logits for (`StepResult.token_ids`), and keeps it on the device per slot. A
decode whose `token_id` is PLACEHOLDER takes that token, so step k+1 can be launched
before step k's tokens reach the host (the async mode; see `launch`).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dlfp.protocol import (
    PLACEHOLDER_TOKEN,
    TIMING_DEVICE_EVENT,
    TIMING_SYNC_WALL,
    Backend,
    BackendError,
    Capabilities,
    PendingStep,
    StepPlan,
    StepResult,
)
from dlfp.backends.torch.config import ModelConfig
from dlfp.backends.torch.model import KVCache, Packed, RotaryTable, Segment
from dlfp.backends.torch.tokenizer import load_tokenizer
from dlfp.backends.torch.weights import materialise

PLACEHOLDER = PLACEHOLDER_TOKEN  # a decode's token id: "the token this slot sampled last, still on the device"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# Options from the environment (the CLI passes only model and profile), e.g. on a GPU box:
# DLFP_TORCH_DEVICE=cuda DLFP_TORCH_DTYPE=bf16.
# DLFP_TORCH_ASYNC=1: pipelined (the engine launches step k+1 before collecting step k).
DEVICE_ENV, DTYPE_ENV, SEED_ENV, ASYNC_ENV = "DLFP_TORCH_DEVICE", "DLFP_TORCH_DTYPE", "DLFP_TORCH_SEED", "DLFP_TORCH_ASYNC"
_WORKER = "dlfp-torch-step"  # the CPU worker thread's name


@dataclass
class _Inputs:
    """A step's inputs as host arrays, built on the launching thread."""

    ids: np.ndarray  # [3, N] int64: token ids (PLACEHOLDER where the device's token goes), positions, slots
    segments: list[Segment]
    logit_rows: list[int]  # the row of each logits row's last token
    slots: list[int]  # the slot of each logits row, in row order


@dataclass
class _Launched:
    slots: list[int]  # the slot of each logits row, in row order
    # CUDA: host (pinned) [R, vocab] float32 logits and [R] int64 greedy tokens, final once
    # the end event has completed; the events time the step.
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    work: Future | None = None  # CPU: the worker's (logits, tokens, seconds)


class LaunchedStep(PendingStep):
    """A launched step. `wait()` blocks until its results are on the host, once."""

    def __init__(self, backend: "TorchBackend", launched: _Launched):
        self._backend = backend
        self._launched = launched
        self._result: StepResult | None = None

    def wait(self) -> StepResult:
        if self._result is None:
            self._result = self._backend._collect(self._launched)
        return self._result


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, cfg: ModelConfig, folder: Path | None, *, n_seq: int, n_ctx: int, n_batch: int,
                 device: str | None = None, dtype: str | None = None, seed: int = 0, n_threads: int | None = None,
                 pipelined: bool = False):
        self.cfg = cfg
        self.pipelined = pipelined  # read by the engine: launch ahead, placeholders, device tokens
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        dtype_name = dtype or ("bfloat16" if self.cuda else "float32")
        if dtype_name not in DTYPES:
            raise ValueError(f"unknown dtype {dtype_name!r}; one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[dtype_name]
        if n_threads and not self.cuda:
            torch.set_num_threads(n_threads)
        self._threads = None if self.cuda else torch.get_num_threads()
        n_ctx = min(n_ctx, cfg.max_positions)
        self.model, self.weights = materialise(cfg, folder, self.device, self.dtype, seed)
        self.cache = KVCache(cfg, n_seq, n_ctx, self.dtype, self.device)
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, n_ctx, self.device)
        self.tokenizer = load_tokenizer(folder, cfg.vocab_size)
        self._last_token = torch.zeros(n_seq, dtype=torch.long, device=self.device)
        self._has_token = [False] * n_seq  # host view: which slots hold a device-sampled token
        self._length = [0] * n_seq  # positions filled per slot (host bookkeeping for checks)
        # CPU: the stream's stand-in (one thread: steps run in launch order, like a CUDA stream).
        self._worker = None if self.cuda else ThreadPoolExecutor(1, thread_name_prefix=_WORKER)
        self.capabilities = Capabilities(
            owned_loop=True, multi_sequence=True, per_step_chunking=True,
            timing=TIMING_DEVICE_EVENT if self.cuda else TIMING_SYNC_WALL,
            max_sequences=n_seq, context_per_sequence=n_ctx, max_batch_tokens=n_batch,
            vocab_size=cfg.vocab_size)

    # -- the protocol ------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).wait()

    def launch(self, plan: StepPlan) -> "LaunchedStep":
        """Check the plan, queue its work on the device and return without waiting for it.

        Raises BackendError before anything is queued if the plan is bad.
        """
        self._check(plan)
        inputs = self._pack(plan)
        for s in inputs.slots:
            self._has_token[s] = True
        if not self.cuda:
            return LaunchedStep(self, _Launched(inputs.slots, work=self._worker.submit(self._timed, inputs)))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # before the inputs' copies: they are the step's work too
        logits, tokens = self._run(inputs)
        host_logits, host_tokens = self._to_host(logits), self._to_host(tokens)
        end.record()
        return LaunchedStep(self, _Launched(inputs.slots, host_logits, host_tokens, start, end))

    def free_sequence(self, seq_id: int) -> None:
        self._check_slot(seq_id)
        self._length[seq_id] = 0  # the cache rows are overwritten before they are read again
        self._has_token[seq_id] = False

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.cfg.eos_ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.chat(messages)

    def describe(self) -> dict:
        desc = {
            "name": self.name,
            "architecture": self.cfg.architecture,
            "layers": self.cfg.num_layers,
            "hidden_size": self.cfg.hidden_size,
            "weights": self.weights,
            "tokenizer": self.tokenizer.kind,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "kv_cache_gib": round(self.cache.nbytes() / 2**30, 3),
            "threads": self._threads,
            "pipelined": self.pipelined,
        }
        if self.cuda:
            desc["gpu"] = torch.cuda.get_device_name(self.device)
            desc["cuda"] = torch.version.cuda
        return desc

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elif self._worker is not None:  # queued steps finish first, unless this is the worker itself
            self._worker.shutdown(wait=not threading.current_thread().name.startswith(_WORKER))

    # -- internals ---------------------------------------------------------
    def _collect(self, launched: _Launched) -> StepResult:
        device_s = None
        if launched.work is not None:
            logits_t, tokens_t, duration = launched.work.result()  # raises what the step raised
        else:
            launched.end.synchronize()  # the step and its copies to the host are done
            device_s = duration = launched.start.elapsed_time(launched.end) / 1e3  # ms on the device's clock
            logits_t, tokens_t = launched.logits, launched.tokens
        rows = logits_t.numpy()
        toks = tokens_t.numpy()
        logits = {slot: rows[i] for i, slot in enumerate(launched.slots)}  # fresh buffers per step: final
        token_ids = {slot: int(toks[i]) for i, slot in enumerate(launched.slots)}
        return StepResult(logits=logits, duration_s=duration, device_duration_s=device_s, token_ids=token_ids)

    def _run(self, inputs: _Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's device work, in stream order: inputs over, the forward, greedy tokens kept per slot."""
        dev = self._to_device(torch.from_numpy(inputs.ids))
        tok = dev[0]
        if (inputs.ids[0] == PLACEHOLDER).any():  # async decodes: the token sampled on the device
            tok = torch.where(tok == PLACEHOLDER, self._last_token[dev[2]], tok)
        rows = self._to_device(torch.tensor(inputs.logit_rows, dtype=torch.long))
        logits = self.model(Packed(tok, dev[1], dev[2], inputs.segments, rows), self.cache, self.rope)
        tokens = logits.argmax(dim=-1)
        if inputs.slots:
            self._last_token[self._to_device(torch.tensor(inputs.slots, dtype=torch.long))] = tokens
        return logits, tokens

    def _timed(self, inputs: _Inputs) -> tuple[torch.Tensor, torch.Tensor, float]:
        """On the CPU worker: the step from when the worker starts it to when its results are ready."""
        if torch.get_num_threads() != self._threads:  # the setting is per thread: the loader's count
            torch.set_num_threads(self._threads)
        t0 = time.perf_counter()
        logits, tokens = self._run(inputs)
        return logits, tokens, time.perf_counter() - t0

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device without waiting for queued work (pinned source, non-blocking copy)."""
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def _pack(self, plan: StepPlan) -> _Inputs:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[Segment] = []
        logit_rows: list[int] = []
        logit_slots: list[int] = []
        for d in plan.decodes:
            segments.append(Segment(d.seq_id, len(tokens), 1, d.position))
            logit_rows.append(len(tokens))
            logit_slots.append(d.seq_id)
            tokens.append(d.token_id)
            positions.append(d.position)
            slots.append(d.seq_id)
            self._length[d.seq_id] = d.position + 1
        for c in plan.prefills:
            segments.append(Segment(c.seq_id, len(tokens), len(c.token_ids), c.start))
            tokens += c.token_ids
            positions += range(c.start, c.end)
            slots += [c.seq_id] * len(c.token_ids)
            if c.wants_logits:
                logit_rows.append(len(tokens) - 1)
                logit_slots.append(c.seq_id)
            self._length[c.seq_id] = c.end
        return _Inputs(np.array([tokens, positions, slots], dtype=np.int64), segments, logit_rows, logit_slots)

    def _check(self, plan: StepPlan) -> None:
        caps = self.capabilities
        if plan.is_empty():
            raise BackendError("empty step")
        if plan.n_tokens > caps.max_batch_tokens:
            raise BackendError(f"step of {plan.n_tokens} tokens exceeds max_batch_tokens {caps.max_batch_tokens}")
        seen: set[int] = set()
        for d in plan.decodes:
            self._check_slot(d.seq_id, seen)
            if d.token_id == PLACEHOLDER:
                if not self._has_token[d.seq_id]:
                    raise BackendError(f"slot {d.seq_id}: placeholder decode but no token was sampled on the device")
            else:
                self._check_tokens([d.token_id])
            self._check_span(d.seq_id, d.position, d.position + 1)
        for c in plan.prefills:
            self._check_slot(c.seq_id, seen)
            if not c.token_ids:
                raise BackendError(f"slot {c.seq_id}: empty prefill chunk")
            self._check_tokens(c.token_ids)
            self._check_span(c.seq_id, c.start, c.end)

    def _check_slot(self, slot: int, seen: set[int] | None = None) -> None:
        if not 0 <= slot < self.capabilities.max_sequences:
            raise BackendError(f"slot {slot} outside 0..{self.capabilities.max_sequences - 1}")
        if seen is not None:
            if slot in seen:
                raise BackendError(f"slot {slot} appears twice in one step")
            seen.add(slot)

    def _check_tokens(self, ids: list[int]) -> None:
        vocab = self.capabilities.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BackendError(f"token id {bad[0]} outside the vocabulary (0..{vocab - 1})")

    def _check_span(self, slot: int, start: int, end: int) -> None:
        ctx = self.capabilities.context_per_sequence
        if start < 0 or end > ctx:
            raise BackendError(f"slot {slot}: positions {start}..{end - 1} outside the context of {ctx}")
        if start > self._length[slot]:
            raise BackendError(f"slot {slot}: step starts at position {start} but only {self._length[slot]} are filled")


def from_profile(model_path: str | None, profile, n_threads: int | None = None, *, device: str | None = None,
                 dtype: str | None = None, seed: int | None = None, **_ignored) -> TorchBackend:
    """`model_path`: a Hugging Face folder (config.json, safetensors, tokenizer), a config.json,
    or a bundled config name (`tiny`, `qwen3-0.6b`, `qwen3-8b`: random weights). Default: `tiny`."""
    spec = model_path or "tiny"
    cfg = ModelConfig.load(spec)
    p = Path(spec)
    folder = p if p.is_dir() else p.parent if p.is_file() else None
    lim = profile.limits
    return TorchBackend(
        cfg, folder, n_seq=lim.max_sequences, n_ctx=lim.context_per_sequence, n_batch=lim.max_batch_tokens,
        device=device or os.environ.get(DEVICE_ENV) or None, dtype=dtype or os.environ.get(DTYPE_ENV) or None,
        seed=int(seed if seed is not None else os.environ.get(SEED_ENV) or 0), n_threads=n_threads,
        pipelined=os.environ.get(ASYNC_ENV, "0") not in ("", "0"))
