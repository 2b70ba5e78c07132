"""Engine mode: MLC-LLM's own serving engine (`AsyncMLCEngine`), steered from outside.

MLC's engine schedules its own steps and fixes `prefill_chunk_size` when it loads,
so dlfp cannot size the prompt tokens of a step here. What it can do:
- set `prefill_chunk_size` (and sequence/context limits) from the device profile at load;
- stream every request, timing each chunk as it arrives, and keep MLC's own
  per-request metrics (`usage.extra`: ttft_s, inter_token_latency_s, ...);
- hold background requests back while the foreground's measured ITL is over its
  target: admission control is the only run-time lever this mode has.

This is a `RunTarget` (open/submit/close), not a steppable `Backend`. MLC-LLM has
no package on PyPI; it installs from MLC's own wheel channel (INSTALL_HINT).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dlfp.protocol import Capabilities
from dlfp.sequence import BACKGROUND, FOREGROUND, Request
from dlfp.trace import RequestRecord, Trace

INSTALL_HINT = (
    "MLC-LLM is not installed (it has no package on PyPI). Install it from MLC's wheel channel, e.g. "
    "`pip install --pre -f https://mlc.ai/wheels mlc-llm-nightly-cpu mlc-ai-nightly-cpu` "
    "(pick the CUDA/ROCm/Metal variant for your device; see https://llm.mlc.ai/docs/install/mlc_llm.html)"
)
TIMING_ENGINE = "engine-internal"  # MLC times its own steps; dlfp sees only the stream
# The one policy this mode has: background requests held back while the foreground's ITL is
# over target. Not `dlfp`, which sizes each step's prompt tokens and cannot act here.
ADMISSION = "admission"
CLOSE_TIMEOUT_S = 600.0  # close() waits this long for running requests, then aborts them
ABORT_WAIT_S = 5.0


def import_mlc():
    try:
        import mlc_llm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from None
    return mlc_llm


# -- what a stream says -------------------------------------------------------
@dataclass
class StreamRecorder:
    """Folds MLC's OpenAI-style stream chunks (chat or completion) into one request's record."""

    token_times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    counted_by_logprobs: bool = True
    inferred_tokens: int = 0  # tokens MLC streamed in no chunk (see reconcile)

    def on_chunk(self, chunk, t: float) -> None:
        data = chunk.model_dump() if hasattr(chunk, "model_dump") else chunk
        if data.get("usage"):
            self.usage = data["usage"]  # the final chunk: counts plus MLC's metrics in `extra`
            self._reconcile()
        for choice in data.get("choices") or []:
            piece = _choice_text(choice)
            n = _choice_tokens(choice)
            if n is None:  # no logprobs: one engine step per chunk, one token per step
                self.counted_by_logprobs = False
                n = 1 if piece else 0
            self.token_times.extend([t] * n)
            if piece:
                self.text.append(piece)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _reconcile(self) -> None:
        """Count the tokens of chunks MLC dropped.

        MLC's stream skips a step whose text is empty (a token holding back part of a
        UTF-8 character, or one with no text) and its logprobs with it, so counting
        chunks undercounts. The final usage has the true count; the missing tokens'
        text rode in a later chunk, so they are counted at the last chunk that carried
        text (their exact step is unknown) and `inferred_tokens` says how many.
        """
        total = (self.usage or {}).get("completion_tokens")
        if not isinstance(total, int) or total <= len(self.token_times) or not self.token_times:
            return
        missing = total - len(self.token_times)
        self.token_times.extend([self.token_times[-1]] * missing)
        self.inferred_tokens += missing

    @property
    def mlc_metrics(self) -> dict:
        return dict((self.usage or {}).get("extra") or {})

    def problems(self) -> list[str]:
        """Disagreements between what the stream showed and what MLC's usage says."""
        out = []
        if self.inferred_tokens:
            out.append(f"{self.inferred_tokens} token(s) came in chunks MLC dropped (empty text): "
                       "counted from usage at the last text chunk")
        if self.usage is None:
            out.append("no usage chunk (request stream_options.include_usage)")
        elif self.usage.get("completion_tokens") != len(self.token_times):
            out.append(f"usage says {self.usage.get('completion_tokens')} completion tokens, "
                       f"the stream carried {len(self.token_times)}")
        if self.finish_reason is None:
            out.append("stream ended without a finish_reason")
        return out

    def record(self, request: Request, arrival_s: float, finished_s: float, error: str | None) -> RequestRecord:
        return RequestRecord(
            request_id=request.request_id,
            priority=request.priority,
            tag=request.tag,
            arrival_s=arrival_s,
            prompt_len=len(request.prompt_ids),
            output_ids=[],  # the OpenAI protocol returns text, not ids: no exact-id comparison here
            token_times=list(self.token_times),
            finish_reason=self.finish_reason if error is None else "error",
            error=error,
            finished_s=finished_s,
        )


def _choice_text(choice: dict) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _choice_tokens(choice: dict) -> int | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if "content" in lp:  # chat: one entry per token
        return len(lp["content"] or [])
    return len(lp.get("tokens") or [])  # completion


def metrics_dict(metrics) -> dict:
    """MLC's `metrics()` result as a dict: an `EngineMetrics` (a `.metrics` dict behind
    `__getitem__`, no `keys()`: `dict(m)` raises KeyError 0), or a dict."""
    inner = getattr(metrics, "metrics", metrics)
    if hasattr(inner, "model_dump"):
        inner = inner.model_dump()
    if not isinstance(inner, dict):
        raise TypeError(f"unexpected metrics payload {type(metrics).__name__}")
    return dict(inner)


def engine_metrics_summary(metrics: dict) -> dict:
    """The engine-wide figures of MLC's `metrics()` payload that a trace keeps."""
    keep = ("engine_prefill_time_sum", "engine_decode_time_sum", "prefill_tokens_sum", "decode_tokens_sum",
            "prefill_tokens_per_s", "decode_tokens_per_s", "decode_time_by_batch_size")
    return {k: metrics[k] for k in keep if k in metrics}


# -- the only run-time lever ---------------------------------------------------
class BackgroundAdmission:
    """How many background requests may be in flight, from the foreground's measured ITL.

    While a foreground request streams, a gap over the target closes admission and
    each gap under it opens one more slot (additive increase, as DLFP grows its cap
    back). Requests already admitted run to the end: MLC's engine cannot pause one,
    so the lever acts on the next admission only.
    """

    def __init__(self, target_s: float | None, max_inflight: int):
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.target_s = target_s
        self.max_inflight = max_inflight
        self.level = max_inflight

    def observe_fg_gap(self, gap_s: float) -> None:
        if self.target_s is None:
            return
        self.level = 0 if gap_s > self.target_s else min(self.max_inflight, self.level + 1)

    def allowed(self, fg_active: bool) -> int:
        if self.target_s is None or not fg_active:
            return self.max_inflight
        return self.level


# -- the run target --------------------------------------------------------------
class EngineHandle:
    def __init__(self, request: Request, arrival_s: float):
        self.request_id = request.request_id
        self.request = request
        self.arrival_s = arrival_s
        self.recorder = StreamRecorder()
        self.record: RequestRecord | None = None
        self._done = threading.Event()

    @property
    def text(self) -> str:
        return "".join(self.recorder.text)

    def result(self, timeout: float | None = None) -> RequestRecord:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        assert self.record is not None
        return self.record


class MLCEngineTarget:
    """dlfp's RunTarget over an `AsyncMLCEngine` (or any object with its completions API)."""

    label = "mlc-engine"

    def __init__(self, engine, profile, prefill_chunk_size: int, itl_target_ms: float | None = None,
                 model: str | None = None, clock=time.perf_counter, context_per_sequence: int | None = None,
                 engine_settings: dict | None = None):
        self.engine = engine
        self.profile = profile
        self.model = model
        self.clock = clock
        self.prefill_chunk_size = prefill_chunk_size
        self.engine_settings = dict(engine_settings or {})  # what make_target set, clamped or left out
        self.target_s = (itl_target_ms if itl_target_ms is not None else profile.itl_target_ms) / 1e3
        self.capabilities = Capabilities(
            owned_loop=False,  # MLC's engine runs its own loop
            multi_sequence=True,
            per_step_chunking=False,  # prefill_chunk_size is fixed when the engine loads
            timing=TIMING_ENGINE,
            max_sequences=profile.max_sequences,
            context_per_sequence=context_per_sequence or per_sequence_context(profile),
            max_batch_tokens=prefill_chunk_size,
            vocab_size=0,  # unknown without MLC's tokenizer; the engine validates ids itself
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dlfp-mlc-engine", daemon=True)
        self._thread.start()
        self._reset()

    def _reset(self) -> None:
        self.trace = Trace(origin=self.clock())
        self.admission: BackgroundAdmission | None = None
        self._handles: list[EngineHandle] = []
        self._waiting_bg: deque[EngineHandle] = deque()
        self._bg_inflight = 0
        self._fg_active = 0
        self._fg_last: dict[str, float] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    # -- RunTarget ---------------------------------------------------------
    def open(self, policy: str) -> None:
        self._reset()
        for note in self.engine_settings.get("notes", []):
            self.trace.note(f"mlc engine mode: {note}")
        bg_limit = max(1, self.profile.max_sequences - 1)  # one sequence stays free for the foreground
        if policy == "unbounded":
            self.admission = BackgroundAdmission(None, bg_limit)
        elif policy == ADMISSION:
            self.admission = BackgroundAdmission(self.target_s, bg_limit)
            self.trace.note("mlc engine mode: background admission only, against the ITL target; "
                            f"prefill_chunk_size fixed at {self.prefill_chunk_size} by the engine")
        else:
            raise ValueError(f"mlc engine mode cannot run policy {policy!r}: it fixes prefill_chunk_size at load, "
                             f"so only 'unbounded' and '{ADMISSION}' (background admission control) apply")

    def submit(self, request: Request) -> EngineHandle:
        if self.admission is None:
            raise RuntimeError("open() first")
        handle = EngineHandle(request, self.clock())
        try:
            request.validate(vocab_size=2**31 - 1, context=self.capabilities.context_per_sequence)
        except ValueError as exc:
            self.trace.add_request(handle.recorder.record(request, handle.arrival_s, handle.arrival_s, str(exc)))
            raise
        self._handles.append(handle)
        self._loop.call_soon_threadsafe(self._arrive, handle)
        return handle

    def close(self, timeout_s: float | None = CLOSE_TIMEOUT_S) -> Trace:
        """Wait for every request (at most `timeout_s` in all), abort the rest, keep the trace."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for h in list(self._handles):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h._done.wait(left):
                break
        late = [h for h in self._handles if not h._done.is_set()]
        if late:
            self.trace.note(f"mlc engine mode: close() aborted {len(late)} request(s) still running after {timeout_s} s")
            self._loop.call_soon_threadsafe(self._cancel_all)
            for h in late:
                h._done.wait(ABORT_WAIT_S)
        try:
            metrics = self._call_soon(self._engine_metrics())
        except TimeoutError:
            self.trace.note("mlc engine metrics: no answer in time")
            metrics = None
        if metrics:
            self.trace.add_sample({"t": self.clock() - self.trace.origin, "source": "mlc-engine-metrics",
                                   **engine_metrics_summary(metrics)})
        trace = self.trace
        self.admission = None
        return trace

    def describe(self) -> dict:
        return {
            "name": self.label,
            "mode": "engine",
            "model_path": self.model,
            "prefill_chunk_size": self.prefill_chunk_size,
            "engine_settings": self.engine_settings,
            "capabilities": vars(self.capabilities),
            "profile": self.profile.name,
            "mlc_llm": _mlc_version(),
        }

    def shutdown(self) -> None:
        terminate = getattr(self.engine, "terminate", None)
        if terminate is not None:
            terminate()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- on the event loop --------------------------------------------------
    def _arrive(self, handle: EngineHandle) -> None:
        if handle.request.priority == FOREGROUND:
            self._fg_active += 1
            self._start(handle)
        else:
            self._waiting_bg.append(handle)
            self._admit()

    def _admit(self) -> None:
        allowed = self.admission.allowed(self._fg_active > 0) if self.admission else 0
        while self._waiting_bg and self._bg_inflight < allowed:
            self._bg_inflight += 1
            self._start(self._waiting_bg.popleft())

    def _start(self, handle: EngineHandle) -> None:
        self._tasks[handle.request_id] = self._loop.create_task(self._run(handle))

    def _cancel_all(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        while self._waiting_bg:  # never admitted: end them with an error too
            h = self._waiting_bg.popleft()
            h.record = h.recorder.record(h.request, h.arrival_s, self.clock(), "aborted at close before admission")
            self.trace.add_request(h.record)
            h._done.set()

    async def _run(self, handle: EngineHandle) -> None:
        req, error = handle.request, None
        try:
            stream = await self.engine.completions.create(**_completion_args(req))
            async for chunk in stream:
                before = len(handle.recorder.token_times)
                handle.recorder.on_chunk(chunk, self.clock())
                if req.priority == FOREGROUND and len(handle.recorder.token_times) > before:
                    self._observe_fg(handle)
        except asyncio.CancelledError:  # close() ran out of time: stop MLC's work on it too
            error = "aborted: still running when close() timed out"
            await self._abort(req.request_id)
        except Exception as exc:  # the engine's errors end this request, not the run
            error = f"{type(exc).__name__}: {exc}"
        self._tasks.pop(req.request_id, None)
        for problem in handle.recorder.problems() if error is None else []:
            self.trace.note(f"{req.request_id}: {problem}")
        handle.record = handle.recorder.record(req, handle.arrival_s, self.clock(), error)
        self.trace.add_request(handle.record)
        if req.priority == FOREGROUND:
            self._fg_active -= 1
            self._fg_last.pop(req.request_id, None)
        else:
            self._bg_inflight -= 1
        handle._done.set()
        self._admit()

    def _observe_fg(self, handle: EngineHandle) -> None:
        t = handle.recorder.token_times[-1]
        prev = self._fg_last.get(handle.request_id)
        self._fg_last[handle.request_id] = t
        if prev is not None and self.admission is not None:
            self.admission.observe_fg_gap(t - prev)
            self._admit()

    async def _abort(self, request_id: str) -> None:
        abort = getattr(self.engine, "abort", None)
        if abort is None:
            return
        try:
            out = abort(request_id)
            if asyncio.iscoroutine(out):
                await out
        except Exception as exc:
            self.trace.note(f"{request_id}: MLC abort failed: {type(exc).__name__}: {exc}")

    async def _engine_metrics(self) -> dict | None:
        fn = getattr(self.engine, "metrics", None)
        if fn is None:
            return None
        try:
            out = fn()
            out = await out if asyncio.iscoroutine(out) else out
            return metrics_dict(out)
        except Exception as exc:
            self.trace.note(f"mlc engine metrics unavailable: {type(exc).__name__}: {exc}")
            return None

    def _call_soon(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)


def _completion_args(req: Request) -> dict:
    args = {
        "prompt": list(req.prompt_ids),  # MLC's completions take token ids: the exact prompt
        "max_tokens": req.max_tokens,
        "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,  # per-chunk token lists, so the stream counts tokens exactly
        "request_id": req.request_id,
    }
    if req.sampling.seed is not None:
        args["seed"] = req.sampling.seed
    if req.ignore_eos:
        args["extra_body"] = {"debug_config": {"ignore_eos": True}}
    return args


def _mlc_version() -> str:
    try:
        import mlc_llm

        return getattr(mlc_llm, "__version__", "installed")
    except ImportError:
        return "not installed"


def per_sequence_context(profile) -> int:
    """Positions one sequence may hold (MLC's max_single_sequence_length)."""
    return profile.context_per_sequence


def compiled_limits(model: str) -> dict:
    """The limits a compiled MLC model folder was built with (mlc-chat-config.json), if it is a local folder."""
    import json
    from pathlib import Path

    path = Path(model) / "mlc-chat-config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    return {k: cfg[k] for k in ("prefill_chunk_size", "context_window_size", "max_batch_size") if isinstance(cfg.get(k), int)
            and cfg[k] > 0}


def engine_settings(profile, model: str, prefill_chunk_size: int | None, config_fields: set[str]) -> tuple[dict, list[str]]:
    """EngineConfig keyword arguments from the profile, clamped to the compiled limits; notes on what changed.

    - max_total_sequence_length is MLC's KV capacity over all sequences; the
      per-sequence bound is max_single_sequence_length.
    - The radix prefix cache is off: a repeated prompt would skip its prefill, and
      the policies under comparison would not see the same work.
    - Prefill mode "chunked", not "hybrid" (split-fuse): each engine step is then a
      plain prefill or decode step, as the admission lever assumes.
    """
    notes = []
    limits = compiled_limits(model)
    chunk = prefill_chunk_size or profile.max_batch_tokens
    if "prefill_chunk_size" in limits and chunk > limits["prefill_chunk_size"]:
        notes.append(f"prefill_chunk_size {chunk} clamped to the compiled library's {limits['prefill_chunk_size']}")
        chunk = limits["prefill_chunk_size"]
    single = per_sequence_context(profile)
    if "context_window_size" in limits and single > limits["context_window_size"]:
        notes.append(f"max_single_sequence_length {single} clamped to the model's context {limits['context_window_size']}")
        single = limits["context_window_size"]
    wanted = {
        "max_num_sequence": profile.max_sequences,
        "max_total_sequence_length": profile.max_sequences * profile.context_per_sequence,  # the KV of all
        "max_single_sequence_length": single,
        "prefill_chunk_size": chunk,  # fixed for the engine's life: why this mode has no per-step lever
        "prefix_cache_mode": "disable",
        "prefill_mode": "chunked",
    }
    settings = {k: v for k, v in wanted.items() if k in config_fields}
    left = sorted(set(wanted) - set(settings))
    if left:
        notes.append(f"this mlc_llm's EngineConfig has no {left}: left at MLC's defaults")
    return settings, notes


def make_target(model: str | None, profile, itl_target_ms: float | None = None, device: str = "auto",
                prefill_chunk_size: int | None = None) -> MLCEngineTarget:
    """Load MLC-LLM's AsyncMLCEngine with limits from the device profile (EXTERNAL_TARGETS factory)."""
    mlc_llm = import_mlc()
    if model is None:
        raise ValueError("mlc engine mode needs --model (an MLC model folder or HF://mlc-ai/... id)")
    import dataclasses

    from mlc_llm.serve import EngineConfig

    settings, notes = engine_settings(profile, model, prefill_chunk_size,
                                      {f.name for f in dataclasses.fields(EngineConfig)})
    engine = mlc_llm.AsyncMLCEngine(model, device=device, mode="server", engine_config=EngineConfig(**settings))
    target = MLCEngineTarget(engine, profile, settings.get("prefill_chunk_size", prefill_chunk_size or profile.max_batch_tokens),
                             itl_target_ms, model=model,
                             context_per_sequence=settings.get("max_single_sequence_length"),
                             engine_settings={**settings, "notes": notes})
    return target
