"""ExecuTorch: a `.pte` stepped one method call per sequence, in a worker process.

The program (see executorch_export.py) has one method `forward(tokens[1, L],
start_pos)` with dynamic L and its KV cache in mutable buffers: a prefill chunk
is one call with L tokens, a decode is one call with L = 1. Why a worker process:
`Method.execute()` is synchronous and holds the GIL for the whole call, so in the
engine's process it would freeze every other thread (HTTP, the chat client, the
probes) for a whole step. The engine thread waits on a pipe instead, which frees
the GIL.

Timing: `execute()` returns once the work is done and the logits are in host
memory, so the worker's wall time around the step's calls is the completed step
time (TIMING_SYNC_WALL); the pipe round trip is not in it. With `etdump=True` the
worker also reads ExecuTorch's own per-execute spans back as `device_duration_s`
(that read costs a flatc decode per step: for checks, not for serving).

Several sequences in one step depend on the program's layout (the sidecar's
"layout"). Per-sequence (the default export): each slot has its own loaded
Program (one KV cache per Program), so a step's items run one after another, not
as one batched kernel, and memory holds one copy of the weights per slot. Packed
(`export-executorch --packed`): one Program whose cache holds every slot; the
step's decodes and chunks go into one execute as [1, T] tokens tagged with their
slot and position, so the linear layers run batched over the whole step and the
weights are loaded once. `multi_sequence=True` (default) declares that a step
may carry several sequences; `multi_sequence=False` refuses such plans and the
scheduler time-slices sequences instead. See backends/README.md.
"""
from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dlfp.protocol import (
    TIMING_SYNC_WALL,
    Backend,
    BackendError,
    Capabilities,
    Limits,
    ModelLoadError,
    StepPlan,
    StepResult,
    physical_cores,
    validate_plan,
)

SIDECAR_FORMAT = "dlfp-executorch/1"
PTE_MAGIC_AT_4 = b"ET"  # a .pte flatbuffer carries the identifier "ET12"-like at byte 4
LOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ExecuTorchConfig:
    model_path: str
    # One Program is loaded per sequence slot; context and step size are also bounded by the program.
    limits: Limits = Limits(max_sequences=4, context_per_sequence=2048, max_batch_tokens=256)
    n_threads: int | None = None  # XNNPACK threads; None: one per physical core
    multi_sequence: bool = True  # several sequences per step, run one after another
    etdump: bool = False  # read ETDump's per-execute spans back as device_duration_s


def read_sidecar(pte: str | os.PathLike) -> dict:
    """The model's tokenizer, template and shape limits, written beside the .pte by the export."""
    p = Path(pte)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {p}")
    with open(p, "rb") as f:
        if f.read(6)[4:6] != PTE_MAGIC_AT_4:
            raise ModelLoadError(f"not an ExecuTorch .pte file: {p}")
    side = Path(str(p) + ".json")
    if not side.is_file():
        raise ModelLoadError(f"no sidecar {side}: export with `dlfp export-executorch` (it writes the tokenizer there)")
    meta = json.loads(side.read_text())
    if meta.get("format") != SIDECAR_FORMAT:
        raise ModelLoadError(f"{side}: unknown format {meta.get('format')!r}")
    return meta


class ByteTokenizer:
    """UTF-8 bytes as tokens (after a few specials): honest for a model with no tokenizer."""

    def __init__(self, spec: dict, template: dict):
        if spec.get("kind") != "bytes":
            raise ModelLoadError(f"unsupported tokenizer kind {spec.get('kind')!r}")
        self.offset, self.bos, self.eos = spec["offset"], spec["bos"], spec["eos"]
        self.template = template

    def encode(self, text: str, add_special: bool) -> list[int]:
        return ([self.bos] if add_special else []) + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return self.token_bytes(ids).decode("utf-8", errors="replace")

    def chat(self, messages: list[dict]) -> list[int]:
        text = "".join(self.template["message"].format(role=m["role"], content=m["content"]) for m in messages)
        return self.encode(text + self.template["generation_prompt"], add_special=True)

    def is_eos(self, token_id: int) -> bool:
        return token_id == self.eos

    def token_bytes(self, ids: list[int], special: bool = False) -> bytes:
        # Specials and ids past the byte range decode to nothing.
        return bytes(t - self.offset for t in ids if self.offset <= t < self.offset + 256)


def load_tokenizer(meta: dict, pte: str | os.PathLike):
    """The sidecar's tokenizer: bytes (tiny test models) or a real one in a folder beside the .pte."""
    spec = meta.get("tokenizer") or {}
    if spec.get("kind") == "hf":
        from dlfp.backends.hf_tokenizer import HFTokenizer

        folder = Path(pte).resolve().parent / spec["folder"]
        try:
            return HFTokenizer(folder)
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"tokenizer folder {folder}: {exc}") from None
    return ByteTokenizer(spec, meta["chat_template"])


class ExecuTorchBackend(Backend):
    name = "executorch"

    def __init__(self, config: ExecuTorchConfig):
        self.config = config
        self.meta = read_sidecar(config.model_path)
        self.tokenizer = load_tokenizer(self.meta, config.model_path)
        self.n_threads = config.n_threads or physical_cores()
        self.packed = self.meta.get("layout", "per-sequence") == "packed"
        # A packed program's cache holds a fixed number of slots: the profile's count is lowered to it.
        n_seq = min(config.limits.max_sequences, int(self.meta["slots"])) if self.packed else config.limits.max_sequences
        self.capabilities = Capabilities(
            owned_loop=True,
            multi_sequence=config.multi_sequence,
            per_step_chunking=True,
            timing=TIMING_SYNC_WALL,
            max_sequences=n_seq,
            context_per_sequence=min(config.limits.context_per_sequence, int(self.meta["max_seq_len"])),
            max_batch_tokens=min(config.limits.max_batch_tokens, int(self.meta["max_chunk"])),
            vocab_size=int(self.meta["vocab_size"]),
            prefix_reuse=True,  # see keep_prefix: both layouts mask by position
        )
        self._filled = [0] * n_seq  # positions each slot holds (cells past it are stale)
        self._conn, self._proc = None, None
        self._runtime_info = self._start_worker()

    def _start_worker(self) -> dict:
        from dlfp.backends import executorch_worker

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or locks
        parent, child = ctx.Pipe()
        args = (child, str(Path(self.config.model_path).resolve()), self.capabilities.max_sequences,
                self.meta.get("method", "forward"), self.n_threads, self.config.etdump, self.packed)
        self._proc = ctx.Process(target=executorch_worker.serve, args=args, name="dlfp-executorch", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(LOAD_TIMEOUT_S):
            self.close()
            raise ModelLoadError(f"ExecuTorch worker did not start within {LOAD_TIMEOUT_S:.0f} s")
        try:
            kind, info = parent.recv()
        except EOFError:
            kind, info = "error", f"ExecuTorch worker exited while loading (exit code {self._proc.exitcode})"
        if kind != "ready":
            self.close()
            raise ModelLoadError(info)
        return info

    def _call(self, message):
        try:
            self._conn.send(message)
            return self._conn.recv()
        except (EOFError, OSError):  # a broken pipe: the worker is gone
            self._proc.join(1)
            raise BackendError(f"the ExecuTorch worker process died (exit code {self._proc.exitcode})") from None

    # -- stepping ----------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        items = self._items(plan)
        if self._conn is None:
            raise BackendError("backend is closed")
        reply = self._call(("step", items))
        if reply[0] != "ok":
            raise BackendError(f"ExecuTorch step failed: {reply[1]}")
        _, logits, duration, device = reply
        for slot, ids, start, _ in items:
            self._filled[slot] = start + len(ids)
        return StepResult(logits=logits, duration_s=duration, device_duration_s=device)

    def _items(self, plan: StepPlan) -> list[tuple[int, list[int], int, bool]]:
        """Validate the plan before it reaches the runtime; one item per sequence."""
        validate_plan(plan, self.capabilities)
        items = [(d.seq_id, [d.token_id], d.position, True) for d in plan.decodes]
        items += [(c.seq_id, list(c.token_ids), c.start, c.wants_logits) for c in plan.prefills]
        for slot, _, start, _ in items:
            if start > self._filled[slot]:
                # The program attends over every cell up to the position: a gap would read stale cells.
                raise BackendError(f"sequence {slot} holds {self._filled[slot]} positions; a chunk at {start} leaves a gap")
        return items

    def free_sequence(self, seq_id: int) -> None:
        # Nothing to clear in the runtime: a new sequence rewrites each cell before any
        # query reads it, and cells past its position are masked to weight zero.
        self._filled[seq_id] = 0

    def keep_prefix(self, seq_id: int, n_tokens: int) -> bool:
        # Both layouts: a token sees only its slot's cells at positions <= its own, and each
        # chunk writes its cells before it reads them, so cells past n_tokens are never read
        # again before they are rewritten. Keeping a prefix is forgetting where the slot ends.
        if not 0 <= n_tokens <= self._filled[seq_id]:
            return False
        self._filled[seq_id] = n_tokens
        return True

    # -- text --------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def is_eos(self, token_id: int) -> bool:
        return self.tokenizer.is_eos(token_id)

    def token_bytes(self, token_ids: list[int], special: bool = False) -> bytes:
        return self.tokenizer.token_bytes(token_ids, special)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.chat(messages)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "model_path": str(Path(self.config.model_path).resolve()),
            "model": self.meta.get("model", {}),
            **asdict(self.capabilities.limits()),
            "multi_sequence": self.config.multi_sequence,
            "layout": "packed" if self.packed else "per-sequence",
            "execution": ("one Program, one execute per step with every sequence packed, in a worker process"
                          if self.packed else
                          "one Program per sequence; a step's items run one after another in a worker process"),
            "etdump": self.config.etdump,
            **self._runtime_info,
        }

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(("close",))
            except (OSError, BrokenPipeError):
                pass
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc = None


def from_profile(
    model_path: str | None,
    profile,
    n_threads: int | None = None,
    multi_sequence: bool = True,
    etdump: bool = False,
) -> ExecuTorchBackend:
    """The registry's factory: slots and step size come from the device profile."""
    if model_path is None:
        raise ModelLoadError("the executorch backend needs --model X.pte (make one with `dlfp export-executorch`)")
    return ExecuTorchBackend(
        ExecuTorchConfig(
            model_path=str(model_path),
            limits=profile.limits,
            n_threads=n_threads,
            multi_sequence=multi_sequence,
            etdump=etdump,
        )
    )
