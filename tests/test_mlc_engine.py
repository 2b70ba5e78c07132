"""The mlc engine-mode adapter against recorded MLC-LLM payloads.

The payloads below follow MLC-LLM's OpenAI-style protocol
(`mlc_llm/protocol/openai_api_protocol.py`: CompletionResponse /
ChatCompletionStreamResponse chunks, CompletionUsage with `extra`) and the
fields of its C++ metrics (`cpp/serve/metrics.cc`: RequestMetrics and
EngineMetrics). Only the live-engine test needs MLC-LLM itself.
"""
import asyncio
import json
import os
import time

import pytest

from dlfp.backends.mlc.engine_mode import (
    INSTALL_HINT,
    BackgroundAdmission,
    MLCEngineTarget,
    StreamRecorder,
    engine_metrics_summary,
    engine_settings,
    make_target,
    metrics_dict,
)
from dlfp.profiles import load_profile
from dlfp.sequence import BACKGROUND, FOREGROUND, Request


def _completion_chunk(text, finish=None):
    return {
        "id": "cmpl-5f0c2a7d1e", "object": "text_completion", "created": 1718000000,
        "model": "Qwen2.5-0.5B-Instruct-q4f16_1-MLC", "usage": None,
        "choices": [{"index": 0, "finish_reason": finish, "text": text, "logprobs": {
            "text_offset": None, "token_logprobs": [-0.41], "tokens": [text], "top_logprobs": [{}]}}],
    }


REQUEST_EXTRA = {
    "prompt_tokens": 9, "completion_tokens": 4, "prefill_tokens": 9, "decode_tokens": 3,
    "jump_forward_tokens": 0, "prefill_tokens_per_s": 1184.2, "decode_tokens_per_s": 46.9,
    "end_to_end_latency_s": 0.0791, "ttft_s": 0.0152, "inter_token_latency_s": 0.0213,
}
COMPLETION_STREAM = [
    _completion_chunk(" The"), _completion_chunk(" tide"), _completion_chunk(" turns"),
    _completion_chunk(".", finish="length"),
    {"id": "cmpl-5f0c2a7d1e", "object": "text_completion", "created": 1718000000, "choices": [],
     "model": "Qwen2.5-0.5B-Instruct-q4f16_1-MLC",
     "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13, "extra": REQUEST_EXTRA}},
]
CHAT_STREAM = [
    {"id": "chatcmpl-8Qw", "object": "chat.completion.chunk", "created": 1718000001, "system_fingerprint": "",
     "model": "Llama-3.2-1B-Instruct-q4f16_1-MLC", "usage": None,
     "choices": [{"index": 0, "finish_reason": None, "delta": {"role": "assistant", "content": "Hello"},
                  "logprobs": {"content": [{"token": "Hello", "logprob": -0.2, "bytes": [72, 101, 108, 108, 111],
                                            "top_logprobs": []}]}}]},
    {"id": "chatcmpl-8Qw", "object": "chat.completion.chunk", "created": 1718000001, "system_fingerprint": "",
     "model": "Llama-3.2-1B-Instruct-q4f16_1-MLC", "usage": None,
     "choices": [{"index": 0, "finish_reason": "stop", "delta": {"role": "assistant", "content": "!"},
                  "logprobs": {"content": [{"token": "!", "logprob": -1.1, "bytes": [33], "top_logprobs": []},
                                           {"token": "<|eot_id|>", "logprob": -0.01, "bytes": None,
                                            "top_logprobs": []}]}}]},
    {"id": "chatcmpl-8Qw", "object": "chat.completion.chunk", "created": 1718000001, "system_fingerprint": "",
     "model": "Llama-3.2-1B-Instruct-q4f16_1-MLC", "choices": [],
     "usage": {"prompt_tokens": 31, "completion_tokens": 3, "total_tokens": 34}},
]
ENGINE_METRICS = {
    "engine_prefill_time_sum": 0.412, "engine_decode_time_sum": 1.873, "engine_jump_forward_time_sum": 0.0,
    "prompt_tokens_sum": 2211, "completion_tokens_sum": 88, "prefill_tokens_sum": 2211, "decode_tokens_sum": 84,
    "jump_forward_tokens_sum": 0, "prefill_tokens_per_s": 5366.5, "decode_tokens_per_s": 44.8,
    "last_finished_request": REQUEST_EXTRA,
    "decode_time_by_batch_size": {"mean{batch_size=1}": 0.0209, "count{batch_size=1}": 60,
                                  "mean{batch_size=2}": 0.0231, "count{batch_size=2}": 12},
    "draft_time_by_batch_size": {}, "verify_time_by_batch_size": {},
}


def test_recorder_folds_a_recorded_completion_stream():
    rec = StreamRecorder()
    for i, chunk in enumerate(json.loads(json.dumps(COMPLETION_STREAM))):
        rec.on_chunk(chunk, t=0.1 * i)
    assert "".join(rec.text) == " The tide turns."
    assert rec.token_times == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert rec.finish_reason == "length" and rec.problems() == []
    assert rec.mlc_metrics["ttft_s"] == 0.0152 and rec.mlc_metrics["inter_token_latency_s"] == 0.0213


def test_recorder_counts_chat_tokens_from_logprobs_including_invisible_ones():
    rec = StreamRecorder()
    for i, chunk in enumerate(CHAT_STREAM):
        rec.on_chunk(chunk, t=float(i))
    assert rec.token_times == [0.0, 1.0, 1.0]  # the end-of-turn token rode in the second chunk
    assert "".join(rec.text) == "Hello!" and rec.finish_reason == "stop"
    assert rec.problems() == [] and rec.mlc_metrics == {}


def test_recorder_reports_what_the_stream_and_usage_disagree_on():
    rec = StreamRecorder()
    for chunk in CHAT_STREAM[:2]:
        stripped = json.loads(json.dumps(chunk))
        stripped["choices"][0]["logprobs"] = None
        rec.on_chunk(stripped, t=1.0)
    assert not rec.counted_by_logprobs and len(rec.token_times) == 2
    assert rec.problems() == ["no usage chunk (request stream_options.include_usage)"]
    rec.on_chunk(CHAT_STREAM[2], t=2.0)  # usage: 3 tokens, the stream showed 2
    assert len(rec.token_times) == 3 and rec.inferred_tokens == 1
    assert rec.problems()[0].startswith("1 token(s) came in chunks MLC dropped")
    over = StreamRecorder()
    over.on_chunk(CHAT_STREAM[0], t=0.0)
    over.on_chunk({"choices": [], "usage": {"completion_tokens": 0}}, t=1.0)
    assert over.problems() == ["usage says 0 completion tokens, the stream carried 1",
                               "stream ended without a finish_reason"]


def test_engine_metrics_summary_keeps_the_engine_wide_figures():
    s = engine_metrics_summary(ENGINE_METRICS)
    assert s["decode_tokens_per_s"] == 44.8 and s["prefill_tokens_sum"] == 2211
    assert "last_finished_request" not in s and s["decode_time_by_batch_size"]["count{batch_size=2}"] == 12


def test_background_admission_follows_the_foreground_itl():
    a = BackgroundAdmission(target_s=0.05, max_inflight=3)
    assert a.allowed(fg_active=True) == 3
    a.observe_fg_gap(0.08)
    assert a.allowed(fg_active=True) == 0 and a.allowed(fg_active=False) == 3
    a.observe_fg_gap(0.02)
    assert a.allowed(fg_active=True) == 1
    for _ in range(5):
        a.observe_fg_gap(0.02)
    assert a.allowed(fg_active=True) == 3
    free = BackgroundAdmission(None, 2)
    free.observe_fg_gap(9.0)
    assert free.allowed(fg_active=True) == 2
    with pytest.raises(ValueError):
        BackgroundAdmission(0.05, 0)


class EngineMetrics:
    """What AsyncMLCEngine.metrics() returns (`mlc_llm/serve/engine_base.py`): the payload in
    `.metrics`, read through `__getitem__`, with no `keys()`, so `dict(m)` raises KeyError: 0."""

    def __init__(self, metrics):
        self.metrics = metrics

    def __getitem__(self, key):
        return self.metrics[key]


def test_metrics_dict_reads_the_real_engine_metrics_type():
    m = EngineMetrics(ENGINE_METRICS)
    with pytest.raises(KeyError):
        dict(m)  # what the adapter used to do
    assert metrics_dict(m)["decode_tokens_per_s"] == 44.8 and metrics_dict(ENGINE_METRICS) == ENGINE_METRICS


def _dropping_stream():
    """A completion stream where MLC dropped one step: its token held back half a UTF-8 character,
    so its chunk had empty text and was skipped with its logprobs (engine_base.process_completion_stream_output)."""
    out = [_completion_chunk(" caf"), _completion_chunk("é!", finish="length")]  # 3 tokens, 2 chunks
    out.append({"id": "cmpl-1", "object": "text_completion", "created": 1, "choices": [], "model": "m",
                "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})
    return out


def test_recorder_counts_tokens_of_dropped_chunks_from_usage():
    rec = StreamRecorder()
    for i, chunk in enumerate(_dropping_stream()):
        rec.on_chunk(chunk, t=float(i))
    assert len(rec.token_times) == 3 and rec.inferred_tokens == 1
    assert rec.token_times == [0.0, 1.0, 1.0]  # the held-back token arrived with the next text
    assert rec.problems() == ["1 token(s) came in chunks MLC dropped (empty text): counted from usage at the last text chunk"]


class ReplayEngine:
    """AsyncMLCEngine's completions API, replaying the recorded stream with a fixed chunk gap."""

    def __init__(self, gaps: dict[str, float]):
        self.gaps = gaps  # priority tag in the request id -> seconds between chunks
        self.calls: list[dict] = []
        self.started: dict[str, float] = {}
        self.completions = self
        self.terminated = False
        self.aborted: list[str] = []

    async def create(self, **kwargs):
        self.calls.append(kwargs)
        self.started[kwargs["request_id"]] = time.perf_counter()
        gap = self.gaps["fg" if kwargs["request_id"].startswith("fg") else "bg"]
        if kwargs["request_id"].startswith("hang"):
            gap = 3600.0

        async def stream():
            for chunk in COMPLETION_STREAM:
                await asyncio.sleep(gap)
                yield json.loads(json.dumps(chunk))

        return stream()

    async def metrics(self):
        return EngineMetrics(ENGINE_METRICS)  # the real type, not a dict

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def terminate(self):
        self.terminated = True


def run_target(policy, fg_gap):
    profile = load_profile("cpu-laptop")
    engine = ReplayEngine({"fg": fg_gap, "bg": 0.001})
    target = MLCEngineTarget(engine, profile, prefill_chunk_size=64, itl_target_ms=10)
    target.open(policy)
    fg = target.submit(Request(list(range(9)), 4, FOREGROUND, request_id="fg-0", ignore_eos=True))
    time.sleep(0.08)  # the foreground is streaming (and, under dlfp, over its target) when ingestion arrives
    bg = target.submit(Request(list(range(20)), 4, BACKGROUND, request_id="bg-0"))
    trace = target.close()
    target.shutdown()
    return engine, target, trace, fg, bg


def test_admission_holds_background_back_while_the_foreground_is_over_target():
    engine, target, trace, fg, bg = run_target("admission", fg_gap=0.03)
    assert engine.started["bg-0"] >= fg.record.token_times[-1]  # admitted only once the foreground ended
    assert {r.request_id for r in trace.requests} == {"fg-0", "bg-0"} and all(r.ok for r in trace.requests)
    assert len(fg.record.token_times) == 4 and fg.text == " The tide turns."
    assert any("background admission only" in n for n in trace.notes)
    assert trace.samples[0]["decode_tokens_per_s"] == 44.8
    assert engine.terminated
    call = engine.calls[0]
    assert call["prompt"] == list(range(9)) and call["stream_options"] == {"include_usage": True}
    assert call["extra_body"] == {"debug_config": {"ignore_eos": True}} and call["logprobs"] == 0


def test_unbounded_admits_background_at_once():
    engine, _, _, fg, _ = run_target("unbounded", fg_gap=0.03)
    assert engine.started["bg-0"] < fg.record.token_times[-1]


def test_engine_mode_declares_it_cannot_chunk_per_step_and_refuses_cap_policies():
    target = MLCEngineTarget(ReplayEngine({}), load_profile("cpu-laptop"), prefill_chunk_size=64)
    caps = target.capabilities
    assert not caps.owned_loop and not caps.per_step_chunking and caps.max_batch_tokens == 64
    with pytest.raises(ValueError, match="fixes prefill_chunk_size at load"):
        target.open("fixed:32")
    target.open("admission")
    with pytest.raises(ValueError, match="empty"):
        target.submit(Request([], 4, FOREGROUND, request_id="bad"))
    assert target.close().requests[0].error == "the prompt is empty"
    target.shutdown()


def test_close_is_bounded_and_aborts_what_still_runs():
    engine = ReplayEngine({"fg": 0.001, "bg": 0.001})
    target = MLCEngineTarget(engine, load_profile("cpu-laptop"), prefill_chunk_size=64)
    target.open("unbounded")
    ok = target.submit(Request(list(range(9)), 4, FOREGROUND, request_id="fg-0"))
    hung = target.submit(Request(list(range(9)), 4, BACKGROUND, request_id="hang-0"))
    t0 = time.perf_counter()
    trace = target.close(timeout_s=0.5)
    target.shutdown()
    assert time.perf_counter() - t0 < 5
    assert ok.record.ok and hung.record.error.startswith("aborted") and engine.aborted == ["hang-0"]
    assert any("aborted 1 request" in n for n in trace.notes)
    assert trace.samples[0]["decode_tokens_per_s"] == 44.8  # the metrics survive an abort


class _Profile:
    name, max_sequences, context_per_sequence, max_batch_tokens, itl_target_ms = "p", 4, 2048, 512, 100.0


def test_engine_settings_split_total_and_single_and_clamp_to_the_compiled_library(tmp_path):
    fields = {"max_num_sequence", "max_total_sequence_length", "max_single_sequence_length", "prefill_chunk_size",
              "prefix_cache_mode", "prefill_mode"}
    (tmp_path / "mlc-chat-config.json").write_text(json.dumps({"prefill_chunk_size": 128, "context_window_size": 1024}))
    settings, notes = engine_settings(_Profile(), str(tmp_path), None, fields)
    assert settings == {"max_num_sequence": 4, "max_total_sequence_length": 8192, "max_single_sequence_length": 1024,
                        "prefill_chunk_size": 128, "prefix_cache_mode": "disable", "prefill_mode": "chunked"}
    assert any("clamped to the compiled library's 128" in n for n in notes)
    old, notes = engine_settings(_Profile(), "HF://mlc-ai/x", 64, fields - {"prefill_mode"})
    assert old["max_single_sequence_length"] == 2048 and old["prefill_chunk_size"] == 64 and "prefill_mode" not in old
    assert any("no ['prefill_mode']" in n for n in notes)


def test_missing_mlc_llm_fails_with_the_install_channel():
    try:
        import mlc_llm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="mlc.ai/wheels"):
            make_target("some-model", load_profile("cpu-laptop"))
    else:
        pytest.skip("mlc_llm is installed: the missing-package message cannot be shown")


def test_live_mlc_engine():
    try:
        import mlc_llm  # noqa: F401
    except ImportError:
        pytest.skip(f"live MLCEngine test: {INSTALL_HINT}")
    model = os.environ.get("DLFP_MLC_MODEL")
    if not model:
        pytest.skip("live MLCEngine test: set DLFP_MLC_MODEL to an MLC model folder or HF://mlc-ai/... id")
    target = make_target(model, load_profile("cpu-laptop"))
    target.open("admission")
    h = target.submit(Request(list(range(100, 140)), 8, FOREGROUND, ignore_eos=True))
    trace = target.close()
    target.shutdown()
    assert h.record.ok and len(h.record.token_times) == 8 and trace.requests
