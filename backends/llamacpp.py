"""llama.cpp through llama-cpp-python's low-level API.

One context holds `n_seq_max` sequences; each step is one `llama_batch` mixing a
decode token per decoding sequence with the prefill chunk(s). `llama_decode` on
the CPU returns when the work is done, so wall time around it is the completed
step time.
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlfp.backends.llama_log import route_native_logs
from dlfp.backends.step_cutter import StepCutter
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

GGUF_MAGIC = b"GGUF"
LLAMA_VOCAB_SPM, LLAMA_VOCAB_BPE = 1, 2  # llama.cpp's enum llama_vocab_type
# SentencePiece writes a space as "▁" (3 bytes) and a piece turns it back into one space,
# so a token may cover up to 3 input bytes per byte of its piece (a literal "▁" in the text).
SPM_SPACE_FACTOR = 3
UTF8_MAX = 4  # an unknown character becomes one token per character at worst (<unk>), never fewer


@dataclass(frozen=True)
class LlamaCppConfig:
    model_path: str
    limits: Limits = Limits(max_sequences=4, context_per_sequence=2048, max_batch_tokens=512)
    n_threads: int | None = None  # None: one per physical core
    kv_unified: bool = False  # one cache for all sequences (see README: a benchmark setting)
    extra_buffers: bool = False  # llama.cpp's repacked weight buffers (AMX); see __init__
    # Flash attention makes a prompt's logits depend on how it was chunked (0.7 logit
    # apart here, enough to flip greedy near-ties across policies); without it every
    # chunking measured gave bit-identical logits, and small chunks ran faster.
    flash_attn: bool = False
    verbose: bool = False


def check_gguf(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelLoadError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"not a GGUF file (bad magic): {p}")
    return p


class _Batch:
    """A llama_batch whose arrays are numpy buffers we own (filled by slicing)."""

    def __init__(self, llama_cpp, capacity: int):
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        self.struct = llama_cpp.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            embd=None,
            pos=self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            n_seq_id=self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def fill(self, plan: StepPlan) -> list[tuple[int, int]]:
        """Lay the plan out; returns (seq_id, batch row) for every row with logits."""
        outputs = []
        n = 0
        for d in plan.decodes:
            self.token[n], self.pos[n], self.seq[n], self.logits[n] = d.token_id, d.position, d.seq_id, 1
            outputs.append((d.seq_id, n))
            n += 1
        for c in plan.prefills:
            k = len(c.token_ids)
            self.token[n : n + k] = c.token_ids
            self.pos[n : n + k] = np.arange(c.start, c.start + k, dtype=np.int32)
            self.seq[n : n + k] = c.seq_id
            self.logits[n : n + k] = 0
            if c.wants_logits:
                self.logits[n + k - 1] = 1
                outputs.append((c.seq_id, n + k - 1))
            n += k
        self.struct.n_tokens = n
        return outputs


class LlamaCppBackend(Backend):
    name = "llamacpp"

    def __init__(self, config: LlamaCppConfig):
        path = check_gguf(config.model_path)
        import llama_cpp

        route_native_logs(llama_cpp, config.verbose)
        self._ll = ll = llama_cpp
        self.config = config
        self.n_threads = config.n_threads or physical_cores()
        self.threads = self.max_threads = self.n_threads
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        # Extra buffer types repack weights for AMX on CPUs that have it; on this
        # project's Xeon that path crashes any multi-token batch (seen with 0.3.36).
        mp.use_extra_bufts = config.extra_buffers
        self._model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load the model: {path}")
        lim = config.limits
        cp = ll.llama_context_default_params()
        # llama.cpp's n_ctx is the cache of all sequences together (each gets n_ctx / n_seq_max).
        cp.n_ctx = lim.context_per_sequence * lim.max_sequences
        cp.n_batch = lim.max_batch_tokens
        cp.n_ubatch = lim.max_batch_tokens  # one micro-batch per step: the step is what we time
        cp.n_seq_max = lim.max_sequences
        cp.n_threads = self.n_threads  # one-token sub-batches use n_threads ...
        cp.n_threads_batch = self.n_threads  # ... any mixed batch uses n_threads_batch
        cp.kv_unified = config.kv_unified
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            ll.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp could not create a context for {path} ({lim})")
        self._vocab = ll.llama_model_get_vocab(self._model)
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        n_batch = ll.llama_n_batch(self._ctx)
        self._batch = _Batch(ll, n_batch)
        self.capabilities = Capabilities(
            owned_loop=True,
            multi_sequence=True,
            per_step_chunking=True,
            timing=TIMING_SYNC_WALL,
            max_sequences=ll.llama_n_seq_max(self._ctx),
            context_per_sequence=ll.llama_n_ctx_seq(self._ctx),
            max_batch_tokens=n_batch,
            vocab_size=self.n_vocab,
            prefix_reuse=self._can_keep_prefix(),
            cut_steps=True,
        )
        self._cutter = StepCutter(ll, self._ctx)
        self._template = self._chat_template()
        self._max_token_bytes: int | None = None

    # -- stepping ----------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        return self._decode(plan, None)

    def step_within(self, plan: StepPlan, limit_s: float | None) -> StepResult:
        return self._decode(plan, limit_s, cuttable=True)

    def cut_step(self) -> None:
        self._cutter.cut()

    def _decode(self, plan: StepPlan, limit_s: float | None, cuttable: bool = False) -> StepResult:
        validate_plan(plan, self.capabilities)  # llama.cpp asserts (kills the process) on an oversized batch
        outputs = self._batch.fill(plan)
        if cuttable:
            self._cutter.arm(limit_s)
        t0 = time.perf_counter()
        rc = self._ll.llama_decode(self._ctx, self._batch.struct)
        t1 = time.perf_counter()
        if cuttable:
            self._cutter.disarm()
        if rc == 2 and cuttable:
            self._forget(plan)
            return StepResult(logits={}, duration_s=t1 - t0, cut=True)
        if rc != 0:
            raise BackendError(f"llama_decode returned {rc}" + (" (KV cache full)" if rc == 1 else ""))
        logits = {}
        for seq_id, row in outputs:
            ptr = self._ll.llama_get_logits_ith(self._ctx, row)
            logits[seq_id] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        return StepResult(logits=logits, duration_s=t1 - t0)

    def _forget(self, plan: StepPlan) -> None:
        """Every cell the cut step wrote: llama.cpp drops only the micro-batch it was computing,
        and a step split per sequence (kv_unified off) may have finished others."""
        starts = [(d.seq_id, d.position) for d in plan.decodes] + [(c.seq_id, c.start) for c in plan.prefills]
        for seq_id, start in starts:
            self._ll.llama_memory_seq_rm(self._mem, seq_id, start, -1)

    def set_threads(self, n: int) -> bool:
        """llama_set_n_threads: decodes and mixed batches alike, from the next llama_decode on."""
        if not 1 <= n <= self.max_threads:
            raise BackendError(f"set_threads({n}): must be within 1..{self.max_threads}")
        self._ll.llama_set_n_threads(self._ctx, n, n)
        self.threads = n
        return True

    def free_sequence(self, seq_id: int) -> None:
        self._ll.llama_memory_seq_rm(self._mem, seq_id, -1, -1)

    def keep_prefix(self, seq_id: int, n_tokens: int) -> bool:
        """Drop the slot's KV from position n_tokens on (llama_memory_seq_rm [n, end))."""
        if not 0 <= seq_id < self.capabilities.max_sequences or n_tokens < 0:
            raise BackendError(f"keep_prefix({seq_id}, {n_tokens}): no such slot or position")
        return bool(self._ll.llama_memory_seq_rm(self._mem, seq_id, n_tokens, -1))

    def _can_keep_prefix(self) -> bool:
        """A cache tail can be dropped exactly only from a plain attention cache: a recurrent
        state cannot be rewound, and a sliding-window cache has already lost old positions."""
        ll, m = self._ll, self._model
        return not (ll.llama_model_is_recurrent(m) or ll.llama_model_is_hybrid(m) or ll.llama_model_n_swa(m) > 0)

    # -- text --------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 16
        buf = (self._ll.llama_token * size)()
        n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, True)
        if n < 0:
            size = -n
            buf = (self._ll.llama_token * size)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, True)
        return list(buf[:n])

    def detokenize(self, token_ids: list[int]) -> str:
        return self.token_bytes(token_ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_ids: list[int], special: bool = False) -> bytes:
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for t in token_ids:
            n = self._ll.llama_token_to_piece(self._vocab, t, buf, 256, 0, special)
            out += buf.raw[:n]
        return bytes(out)

    def max_token_bytes(self) -> int | None:
        """Sound for BPE vocabularies (each token is a run of the input's own bytes, special
        tokens included when rendered as text) and SPM ones (times 3, SPM_SPACE_FACTOR).
        WPM/UGM vocabularies can turn a whole unknown word into one <unk>: no bound, None."""
        if self._max_token_bytes is None:
            kind = self._ll.llama_vocab_type(self._vocab)
            if kind not in (LLAMA_VOCAB_SPM, LLAMA_VOCAB_BPE):
                return None
            buf = ctypes.create_string_buffer(16)
            # llama_token_to_piece returns -size when the buffer is short: |n| is the piece's length either way.
            longest = max(abs(self._ll.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, True))
                          for t in range(self.n_vocab))
            factor = SPM_SPACE_FACTOR if kind == LLAMA_VOCAB_SPM else 1
            self._max_token_bytes = max(UTF8_MAX, longest * factor)
        return self._max_token_bytes

    def is_eos(self, token_id: int) -> bool:
        return bool(self._ll.llama_vocab_is_eog(self._vocab, token_id))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self._template is None:
            raise BackendError("the model has no chat template in its GGUF metadata")
        prompt = self._template(messages=messages).prompt
        return self.tokenize(prompt, add_special=False)

    def _chat_template(self):
        raw = self._ll.llama_model_chat_template(self._model, None)
        if not raw:
            return None
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        bos = self.token_bytes([self._ll.llama_vocab_bos(self._vocab)], special=True).decode(errors="replace")
        eos = self.token_bytes([self._ll.llama_vocab_eos(self._vocab)], special=True).decode(errors="replace")
        return Jinja2ChatFormatter(raw.decode("utf-8"), eos_token=eos, bos_token=bos)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "model_path": str(Path(self.config.model_path).resolve()),
            "max_sequences": self.capabilities.max_sequences,
            "context_per_sequence": self.capabilities.context_per_sequence,
            "max_batch_tokens": self.capabilities.max_batch_tokens,
            "n_threads": self.n_threads,
            "threads_now": self.threads,
            "kv_unified": self.config.kv_unified,
            "flash_attn": self.config.flash_attn,
            "llama_cpp_python": getattr(self._ll, "__version__", "unknown"),
        }

    def close(self) -> None:
        if getattr(self, "_cutter", None) is not None:
            self._cutter.close()
            self._cutter = None
        if self._ctx:
            self._ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None


def from_profile(
    model_path: str | None, profile, n_threads: int | None = None, kv_unified: bool = False
) -> LlamaCppBackend:
    """The target registry's loader: limits come from the device profile."""
    if model_path is None:
        from dlfp.models import default_model_path

        model_path = str(default_model_path())
    return LlamaCppBackend(
        LlamaCppConfig(
            model_path=str(model_path),
            limits=profile.limits,
            n_threads=n_threads,
            kv_unified=kv_unified,
        )
    )
