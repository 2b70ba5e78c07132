"""The llama.cpp backend for real, on a tiny random-weight GGUF the test writes."""
import pytest

pytest.importorskip("llama_cpp")

from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig, ModelLoadError  # noqa: E402
from dlfp.protocol import BackendError, DecodeItem, Limits, PrefillChunk, StepPlan  # noqa: E402
from dlfp.policy import FixedCap, Unbounded  # noqa: E402
from dlfp.engine import Engine, EngineConfig, InvalidRequest  # noqa: E402
from dlfp.sequence import BACKGROUND, Request  # noqa: E402


@pytest.fixture(scope="module")
def backend(tiny_gguf):
    b = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(4, 512, 128), n_threads=1))
    yield b
    b.close()


def greedy(backend, prompt, n):
    """Reference: one sequence alone, whole prefill then n-1 decodes."""
    backend.free_sequence(0)
    out = [int(backend.step(StepPlan(prefills=[PrefillChunk(0, prompt, 0, True)])).logits[0].argmax())]
    for i in range(n - 1):
        r = backend.step(StepPlan(decodes=[DecodeItem(0, out[-1], len(prompt) + i)]))
        out.append(int(r.logits[0].argmax()))
    backend.free_sequence(0)
    return out


def test_capabilities(backend):
    c = backend.capabilities
    assert c.owned_loop and c.multi_sequence and c.per_step_chunking
    assert c.max_sequences == 4 and c.context_per_sequence == 512 and c.max_batch_tokens == 128
    assert c.vocab_size == 512


def test_greedy_output_not_degenerate(backend):
    out = greedy(backend, list(range(10, 40)), 12)
    assert len(set(out)) > 3  # random weights at 1/sqrt(fan_in): not one repeated token


def test_multi_sequence_batch_matches_single(backend):
    p0, p1 = list(range(10, 40)), list(range(100, 125))
    ref0, ref1 = greedy(backend, p0, 6), greedy(backend, p1, 6)
    r = backend.step(StepPlan(prefills=[PrefillChunk(0, p0, 0, True), PrefillChunk(1, p1, 0, True)]))
    out = {0: [int(r.logits[0].argmax())], 1: [int(r.logits[1].argmax())]}
    for i in range(5):
        plan = StepPlan(decodes=[DecodeItem(s, out[s][-1], len(p) + i) for s, p in ((0, p0), (1, p1))])
        r = backend.step(plan)
        for s in (0, 1):
            out[s].append(int(r.logits[s].argmax()))
    assert out[0] == ref0 and out[1] == ref1
    backend.free_sequence(0)
    backend.free_sequence(1)


def test_exact_greedy_with_prefill_chunks_riding_along(backend):
    fg_prompt = list(range(20, 50))
    bg_prompt = list(range(200, 500))
    outs = []
    for policy, with_bg in ((Unbounded(), False), (FixedCap(8), True), (FixedCap(32), True)):
        engine = Engine(backend, policy, EngineConfig(preemption_budget_s=None)).start()
        bg = engine.submit(Request(bg_prompt, 4, BACKGROUND, ignore_eos=True)) if with_bg else None
        fg = engine.submit(Request(fg_prompt, 24, ignore_eos=True))
        outs.append(fg.result(timeout=60).output_ids)
        if bg:
            assert bg.result(timeout=60).ok
        steps = engine.trace.steps
        engine.shutdown()
        if with_bg:
            assert any(s.n_decode and s.n_prefill_bg for s in steps)  # chunks really rode along
    assert outs[0] == outs[1] == outs[2]


def test_freed_slot_starts_clean(backend):
    ref = greedy(backend, list(range(50, 80)), 5)
    backend.step(StepPlan(prefills=[PrefillChunk(0, list(range(300, 400)), 0, False)]))
    backend.free_sequence(0)
    assert greedy(backend, list(range(50, 80)), 5) == ref


def test_oversized_batch_is_refused_not_aborted(backend):
    with pytest.raises(BackendError, match="max_batch_tokens"):
        backend.step(StepPlan(prefills=[PrefillChunk(0, list(range(3, 300)), 0, True)]))
    with pytest.raises(BackendError, match="context"):
        backend.step(StepPlan(decodes=[DecodeItem(0, 5, 600)]))


def test_engine_refuses_prompt_longer_than_context(backend):
    engine = Engine(backend, Unbounded()).start()
    with pytest.raises(InvalidRequest, match="does not fit the context"):
        engine.submit(Request(list(range(3, 503)) + [5] * 20, 4))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.submit(Request([3, 4, 9999], 4))
    ok = engine.submit(Request([3, 4, 5], 2, ignore_eos=True))
    assert ok.result(timeout=30).ok
    engine.shutdown()


def test_generation_stops_at_context_end(tiny_gguf):
    b = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(2, 64, 64), n_threads=1))
    engine = Engine(b, Unbounded()).start()
    r = engine.submit(Request(list(range(3, 50)), 5000, ignore_eos=True)).result(timeout=60)
    engine.shutdown()
    ctx = b.capabilities.context_per_sequence  # llama.cpp rounds small contexts up
    b.close()
    assert r.ok and r.finish_reason == "length" and 47 + len(r.output_ids) == ctx


def test_chat_template_and_tokenizer(backend):
    ids = backend.apply_chat_template([{"role": "user", "content": "hi"}])
    text = backend.detokenize(ids)
    assert "hi" in text and "assistant" in text


def test_bad_model_files(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LlamaCppBackend(LlamaCppConfig(str(tmp_path / "missing.gguf")))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        LlamaCppBackend(LlamaCppConfig(str(junk)))


@pytest.mark.parametrize("chunk", [1, 3, 7, 32])
def test_prompt_logits_do_not_depend_on_chunking(backend, chunk):
    """Bit-identical: the build leaves llamafile's sgemm out and flash attention off."""
    prompt = list(range(5, 105))
    backend.free_sequence(0)
    whole = backend.step(StepPlan(prefills=[PrefillChunk(0, prompt, 0, True)])).logits[0]
    backend.free_sequence(0)
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        r = backend.step(StepPlan(prefills=[PrefillChunk(0, ids, start, start + len(ids) == len(prompt))]))
    backend.free_sequence(0)
    assert float(abs(r.logits[0] - whole).max()) == 0.0


def test_a_cut_step_leaves_every_cache_as_before(backend):
    # A guarded step cut at its deadline (here at once) returns no logits and writes no cell:
    # the decode and the chunk then run again and the outputs are a cut-free run's.
    assert backend.capabilities.cut_steps
    p0, doc = list(range(10, 40)), list(range(200, 260))
    backend.free_sequence(1)
    ref = greedy(backend, p0, 4)
    whole = backend.step(StepPlan(prefills=[PrefillChunk(1, doc, 0, True)])).logits[1]
    backend.free_sequence(1)
    out = [int(backend.step(StepPlan(prefills=[PrefillChunk(0, p0, 0, True)])).logits[0].argmax())]
    for i, start in enumerate((0, 20, 40)):
        plan = StepPlan(decodes=[DecodeItem(0, out[-1], len(p0) + i)],
                        prefills=[PrefillChunk(1, doc[start:start + 20], start, start == 40)])
        cut = backend.step_within(plan, 0.0)
        assert cut.cut and cut.logits == {}
        r = backend.step_within(plan, 60.0)  # a deadline it meets: the step runs whole
        assert not r.cut
        out.append(int(r.logits[0].argmax()))
    assert out == ref
    assert (r.logits[1] == whole).all()
    backend.free_sequence(0)
    backend.free_sequence(1)


def test_a_step_is_cut_from_another_thread_and_a_stray_cut_touches_nothing(backend, capfd):
    # A new turn cuts the background step in flight from the thread that submits it
    # (`cut_step`): the step ends with no logits and no cell written, quietly (a step cut
    # mid-graph logs llama.cpp errors, which are the cut's). A `cut_step` with no step under
    # `step_within` must not reach the next step.
    import threading

    doc = list(range(100, 228))
    plan = StepPlan(prefills=[PrefillChunk(1, doc, 0, True)])
    backend.free_sequence(1)
    whole = backend.step(plan).logits[1]
    backend.free_sequence(1)
    backend.cut_step()  # nothing armed
    assert (backend.step(plan).logits[1] == whole).all()
    backend.free_sequence(1)

    def cut_when_armed():
        while not backend._cutter._armed:
            pass
        backend.cut_step()

    capfd.readouterr()
    cutter = threading.Thread(target=cut_when_armed)
    cutter.start()
    cut = backend.step_within(plan, None)
    cutter.join()
    assert cut.cut and cut.logits == {}
    assert capfd.readouterr().err == ""
    again = backend.step_within(plan, None)  # nothing cuts it: the step runs whole
    assert not again.cut and (again.logits[1] == whole).all()
    backend.free_sequence(1)


def test_llama_cpp_logs_at_their_own_level(backend, capfd):
    # The warning llama.cpp logs for a cut step stays quiet unless verbose, while an error
    # still prints (llama-cpp-python 0.3.36 read ggml's levels from an older enum: warnings
    # printed as errors and errors were hidden).
    from dlfp.backends.llama_log import NATIVE_LOG

    plan = StepPlan(prefills=[PrefillChunk(1, list(range(200, 240)), 0, False)])
    capfd.readouterr()
    assert backend.step_within(plan, 0.0).cut
    assert "removing memory module entries" not in capfd.readouterr().err
    NATIVE_LOG(4, b"an error line\n")
    NATIVE_LOG(5, b"its continuation\n")
    NATIVE_LOG(3, b"a warning line\n")
    err = capfd.readouterr().err
    assert "an error line" in err and "its continuation" in err and "a warning line" not in err
    backend.free_sequence(1)
