"""Step mode: dlfp owns the loop over an MLC-style compiled model's functions.

MLC-LLM's engine picks its prefill chunk once at load. One layer down, the
compiled model exposes `embed`, `batch_prefill`, `batch_decode` and a paged KV
cache driven by `kv_state_begin_forward(kv, seq_ids, lengths)` /
`kv_state_end_forward`. A step lays every sequence's tokens out in one ragged
row: one token per decoding sequence, then each prefill chunk; the cache knows
which rows belong to which sequence. Steps with prefill run `batch_prefill` with
the logit positions the plan asks for; decode-only steps run `batch_decode`, as
MLC's engine does. The step is timed from the embedding to the logits arriving
on the host: that copy waits for the device, so it is the completed time on a
GPU too.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from dlfp.backends.mlc.model_dir import ModelFolder
from dlfp.backends.mlc.tokenizer import load_tokenizer
from dlfp.protocol import (
    TIMING_OUTPUT_READY,
    Backend,
    BackendError,
    Capabilities,
    Limits,
    ModelLoadError,
    StepPlan,
    StepResult,
    validate_plan,
)

KV_FUNCS = ("add_sequence", "remove_sequence", "begin_forward", "end_forward", "popn")
CREATE_KV = ("create_tir_paged_kv_cache", "create_paged_kv_cache")  # MLC's names, older first


@dataclass(frozen=True)
class StepConfig:
    model_dir: str
    # Context is also capped by the model's context window; max_batch_tokens is MLC's prefill_chunk_size.
    limits: Limits = Limits(max_sequences=4, context_per_sequence=4096, max_batch_tokens=512)
    page_size: int = 16
    n_threads: int | None = None


@dataclass
class _Layout:
    """One step's ragged row: token ids, owner sequences, and rows whose logits are wanted."""

    tokens: np.ndarray
    seq_ids: list[int]
    lengths: list[int]
    logit_rows: list[tuple[int, int]]  # (seq_id, row)


def layout(plan: StepPlan) -> _Layout:
    tokens: list[int] = []
    seq_ids, lengths, rows = [], [], []
    for d in plan.decodes:
        rows.append((d.seq_id, len(tokens)))
        tokens.append(d.token_id)
        seq_ids.append(d.seq_id)
        lengths.append(1)
    for c in plan.prefills:
        tokens.extend(c.token_ids)
        seq_ids.append(c.seq_id)
        lengths.append(len(c.token_ids))
        if c.wants_logits:
            rows.append((c.seq_id, len(tokens) - 1))
    return _Layout(np.asarray(tokens, dtype=np.int32), seq_ids, lengths, rows)


class MLCStepBackend(Backend):
    name = "mlc"

    def __init__(self, config: StepConfig):
        import tvm
        from tvm import relax

        self._tvm = tvm
        self.config = config
        self.folder = ModelFolder.open(config.model_dir)
        cfg = self.folder.config
        if cfg["target"] != "llvm":
            raise ModelLoadError(f"model folder targets {cfg['target']!r}; this adapter runs CPU (llvm) builds")
        if config.n_threads is not None and config.n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {config.n_threads}")
        if config.n_threads is not None:
            # TVM sizes each thread's pool from this variable when the pool is first made.
            os.environ["TVM_NUM_THREADS"] = str(config.n_threads)
        self._threads_set_in: int | None = None  # TVM's thread pool is per calling thread
        self.device = tvm.cpu()
        try:
            self._vm = relax.VirtualMachine(tvm.runtime.load_module(str(self.folder.lib_path)), self.device)
            self._params = self._load_params()
        except ValueError:
            raise
        except Exception as exc:  # TVM raises its own error types for a bad library
            raise ModelLoadError(f"could not load the compiled model in {self.folder.path}: {exc}") from None
        self.config = config = self._clamp(config)
        self._fn = {n: self._function(n) for n in ("embed", "batch_prefill", "batch_decode")}
        self._kv_fn = {n: tvm.get_global_func(f"vm.builtin.kv_state_{n}") for n in KV_FUNCS}
        try:
            self.tokenizer = load_tokenizer(cfg["tokenizer"], self.folder.path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"tokenizer of {self.folder.path}: {exc}") from None
        self.hidden = int(cfg["hidden_size"])
        context = min(config.limits.context_per_sequence, int(cfg["context_window_size"]))
        self._kv = self._create_kv(context)
        self._lengths: dict[int, int] = {}  # sequences alive in the cache -> cached positions
        self.capabilities = Capabilities(
            owned_loop=True,
            multi_sequence=True,
            per_step_chunking=True,
            timing=TIMING_OUTPUT_READY,
            max_sequences=config.limits.max_sequences,
            context_per_sequence=context,
            max_batch_tokens=config.limits.max_batch_tokens,
            vocab_size=int(cfg["vocab_size"]),
            prefix_reuse=True,  # the paged cache drops a sequence's tail (popn): see keep_prefix
        )

    def _load_params(self) -> list:
        """The weights in the order the compiled functions take them."""
        tvm, cfg = self._tvm, self.folder.config
        if not self.folder.is_tensor_cache:
            loaded = tvm.runtime.load_param_dict_from_file(str(self.folder.params_path))
            return [loaded[n] for n in cfg["param_names"]]
        names = self._metadata().get("params")
        if names is not None:
            if any(p.get("preprocs") for p in names):
                raise ValueError(f"{self.folder.path}: weights need preprocessing (tensor-parallel shards); "
                                 "step mode runs unsharded models")
            names = [p["name"] for p in names]
        else:  # a library without MLC's metadata: the tensor cache lists the weights in order
            import json

            index = json.loads(self.folder.params_path.read_text())
            names = [r["name"] for shard in index["records"] for r in shard["records"]]
        tvm.get_global_func("vm.builtin.tensor_cache.load")(str(self.folder.path), self.device.dlpack_device_type(), 0)
        try:
            params = tvm.get_global_func("vm.builtin.param_array_from_cache_by_name")(names)
        finally:
            tvm.get_global_func("vm.builtin.tensor_cache.clear")()  # the VM holds its own references
        return list(params)

    def _metadata(self) -> dict:
        """MLC's `_metadata` (param order, compile-time limits) when the library has it."""
        import json

        if not self._vm.module.implements_function("_metadata"):
            return {}
        return json.loads(str(self._vm["_metadata"]()))

    def _clamp(self, config: StepConfig) -> StepConfig:
        """Keep the sizes within the compiled library's limits (mlc-chat-config.json / its metadata)."""
        from dataclasses import replace

        cfg, meta = self.folder.config, self._metadata()
        self.clamped: list[str] = []
        bounds = {"max_batch_tokens": cfg.get("prefill_chunk_size") or meta.get("prefill_chunk_size"),
                  "max_sequences": cfg.get("max_batch_size")}
        changes = {}
        for key, bound in bounds.items():
            if isinstance(bound, int) and bound > 0 and getattr(config.limits, key) > bound:
                changes[key] = bound
                self.clamped.append(f"{key} {getattr(config.limits, key)} -> {bound} (compiled limit)")
        return replace(config, limits=replace(config.limits, **changes))

    def _function(self, name: str):
        try:
            return self._vm[name]
        except (AttributeError, KeyError, RuntimeError):
            raise ModelLoadError(f"compiled model in {self.folder.path} has no function {name!r}") from None

    def _create_kv(self, context: int):
        shape = self._tvm.runtime.ShapeTuple
        c, lim = self.config, self.config.limits
        for name in CREATE_KV:
            if self._vm.module.implements_function(name):
                # Pages for every sequence at full context: a step never runs out of cache.
                return self._vm[name](
                    shape([lim.max_sequences]), shape([lim.max_sequences * context]),
                    shape([lim.max_batch_tokens]), shape([c.page_size]), shape([0]),
                )
        raise ModelLoadError(f"compiled model in {self.folder.path} has none of {CREATE_KV}")

    # -- stepping ----------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        validate_plan(plan, self.capabilities)
        self._configure_threads()
        lay = layout(plan)
        for seq_id, start in [(d.seq_id, d.position) for d in plan.decodes] + [(c.seq_id, c.start) for c in plan.prefills]:
            self._rewind(seq_id, start)
        tvm = self._tvm
        t0 = time.perf_counter()
        try:
            embeds = self._fn["embed"](tvm.runtime.tensor(lay.tokens, self.device), self._params)
            self._kv_fn["begin_forward"](self._kv, tvm.runtime.ShapeTuple(lay.seq_ids), tvm.runtime.ShapeTuple(lay.lengths))
            logits = self._prefill(embeds, lay) if plan.prefills else self._decode(embeds, len(lay.tokens))
            self._kv_fn["end_forward"](self._kv)
        except Exception as exc:  # TVM errors: the step's sequences no longer match our bookkeeping
            for seq_id in lay.seq_ids:
                self.free_sequence(seq_id)
            raise BackendError(f"the compiled model failed this step: {exc}") from None
        t1 = time.perf_counter()
        for seq_id, n in zip(lay.seq_ids, lay.lengths):
            self._lengths[seq_id] += n
        return StepResult(logits={seq: logits[i] for i, (seq, _) in enumerate(lay.logit_rows)}, duration_s=t1 - t0)

    def _prefill(self, embeds, lay: _Layout) -> np.ndarray:
        # batch_prefill needs at least one logit position; a mid-prompt step asks for its last row.
        rows = [r for _, r in lay.logit_rows] or [len(lay.tokens) - 1]
        positions = self._tvm.runtime.tensor(np.asarray(rows, dtype=np.int32), self.device)
        view = embeds._create_view((1, len(lay.tokens), self.hidden))
        out, self._kv = self._fn["batch_prefill"](view, positions, self._kv, self._params)
        return out.numpy()[0]  # the host copy: the step has completed

    def _decode(self, embeds, n: int) -> np.ndarray:
        view = embeds._create_view((n, 1, self.hidden))
        out, self._kv = self._fn["batch_decode"](view, self._kv, self._params)
        return out.numpy()[:, 0]

    def _rewind(self, seq_id: int, start: int) -> None:
        """Make the cache hold exactly `start` positions of `seq_id` before the step appends."""
        have = self._lengths.get(seq_id)
        if have is None:
            self._kv_fn["add_sequence"](self._kv, seq_id)
            self._lengths[seq_id] = have = 0
        if start > have:
            raise BackendError(f"sequence {seq_id} starts at {start} but its cache holds {have} positions")
        if start < have:
            self._kv_fn["popn"](self._kv, seq_id, have - start)  # recompute from `start` (a rewind)
            self._lengths[seq_id] = start

    def _configure_threads(self) -> None:
        """Size the thread pool of the thread that steps (TVM keeps one pool per thread)."""
        tid = threading.get_ident()
        if self.config.n_threads is not None and tid != self._threads_set_in:
            # mode 1 = big cores, then the worker count: the call MLC's runtime makes too.
            self._tvm.get_global_func("runtime.config_threadpool")(1, self.config.n_threads)
            self._threads_set_in = tid

    def keep_prefix(self, seq_id: int, n_tokens: int) -> bool:
        """Drop all but the first `n_tokens` positions of the sequence's pages (popn);
        the next chunk appends at n_tokens, as after a rewind."""
        have = self._lengths.get(seq_id, 0)
        if not 0 <= n_tokens <= have:
            return False
        if n_tokens == 0:
            self.free_sequence(seq_id)
        else:
            self._rewind(seq_id, n_tokens)
        return True

    def free_sequence(self, seq_id: int) -> None:
        if self._lengths.pop(seq_id, None) is not None:
            self._kv_fn["remove_sequence"](self._kv, seq_id)

    # -- text --------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_bytes(self, token_ids: list[int], special: bool = False) -> bytes:
        return self.tokenizer.token_bytes(token_ids, special)

    def is_eos(self, token_id: int) -> bool:
        return self.tokenizer.is_eos(token_id)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.chat(messages)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "mode": "step",
            "model_path": str(self.folder.path.resolve()),
            "runtime": f"apache-tvm {self._tvm.__version__} (a stand-in for MLC-LLM's own TVM build)",
            "device": str(self.device),
            **asdict(self.capabilities.limits()),
            "page_size": self.config.page_size,
            "n_threads": self.config.n_threads or f"tvm default ({self._tvm.runtime.num_threads()})",
            "weights": self.folder.config.get("weights"),
            "format": self.folder.config.get("format"),
            "clamped": self.clamped,
        }

    def close(self) -> None:
        self._kv = None
        self._vm = None
