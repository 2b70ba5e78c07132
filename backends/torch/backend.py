"""The torch backend: dlfp's owned loop over a PyTorch decoder on a GPU (or the CPU, in CI).

One step = one forward over every decode and prompt chunk of the plan (see model.py).
Timing, per the porting guide:
- `duration_s`: wall time from the launch until the step's results are host memory
  (the end event has completed and the copies with it); when steps are pipelined
  (`launch` before the previous `wait`), measured from the later of the launch and the
  previous step's completion, since a step cannot start on the device before that;
- `device_duration_s`: CUDA events recorded around the step on its stream (None on CPU).

Sampling on the device: every step also returns the greedy token of each row it
computed logits for (`StepResult.token_ids`), and keeps it on the device per slot. A
decode whose `token_id` is PLACEHOLDER takes that token, so step k+1 can be launched
before step k's tokens reach the host (the async mode; see `launch`).
"""
from __future__ import annotations

import os
import time
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


@dataclass
class _Launched:
    t_launch: float
    slots: list[int]  # the slot of each logits row, in row order
    logits: torch.Tensor  # host (pinned on CUDA) [R, vocab] float32, filled when the end event completes
    tokens: torch.Tensor  # host [R] int64 greedy tokens
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None


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
        n_ctx = min(n_ctx, cfg.max_positions)
        self.model, self.weights = materialise(cfg, folder, self.device, self.dtype, seed)
        self.cache = KVCache(cfg, n_seq, n_ctx, self.dtype, self.device)
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, n_ctx, self.device)
        self.tokenizer = load_tokenizer(folder, cfg.vocab_size)
        self._last_token = torch.zeros(n_seq, dtype=torch.long, device=self.device)
        self._has_token = [False] * n_seq  # host view: which slots hold a device-sampled token
        self._length = [0] * n_seq  # positions filled per slot (host bookkeeping for checks)
        self._last_ready: float | None = None
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
        t0 = time.perf_counter()
        batch, slots = self._pack(plan)
        start = end = None
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = self.model(batch, self.cache, self.rope)
        tokens = logits.argmax(dim=-1)
        if slots:
            self._last_token[self._to_device(torch.tensor(slots, dtype=torch.long))] = tokens
        host_logits, host_tokens = self._to_host(logits), self._to_host(tokens)
        if self.cuda:
            end.record()
        for s in slots:
            self._has_token[s] = True
        return LaunchedStep(self, _Launched(t0, slots, host_logits, host_tokens, start, end))

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
            "threads": None if self.cuda else torch.get_num_threads(),
            "pipelined": self.pipelined,
        }
        if self.cuda:
            desc["gpu"] = torch.cuda.get_device_name(self.device)
            desc["cuda"] = torch.version.cuda
        return desc

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- internals ---------------------------------------------------------
    def _collect(self, launched: _Launched) -> StepResult:
        if launched.end is not None:
            launched.end.synchronize()  # the step and its copies to the host are done
        t_ready = time.perf_counter()
        begin = launched.t_launch if self._last_ready is None else max(launched.t_launch, self._last_ready)
        self._last_ready = t_ready
        device_s = launched.start.elapsed_time(launched.end) / 1e3 if launched.end is not None else None
        rows = launched.logits.numpy()
        toks = launched.tokens.numpy()
        logits = {slot: rows[i] for i, slot in enumerate(launched.slots)}  # fresh buffers per step: final
        token_ids = {slot: int(toks[i]) for i, slot in enumerate(launched.slots)}
        return StepResult(logits=logits, duration_s=t_ready - begin, device_duration_s=device_s,
                          token_ids=token_ids)

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

    def _pack(self, plan: StepPlan) -> tuple[Packed, list[int]]:
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
        dev = self._to_device(torch.from_numpy(np.array([tokens, positions, slots], dtype=np.int64)))
        tok = dev[0]
        if any(t == PLACEHOLDER for t in tokens):  # async decodes: the token sampled on the device
            tok = torch.where(tok == PLACEHOLDER, self._last_token[dev[2]], tok)
        rows = self._to_device(torch.tensor(logit_rows, dtype=torch.long))
        return Packed(tok, dev[1], dev[2], segments, rows), logit_slots

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
