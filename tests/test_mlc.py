"""The mlc step-mode adapter for real: a tiny model with MLC-LLM's function names,
compiled by apache-tvm for the CPU inside this test session."""
import json

import numpy as np
import pytest

pytest.importorskip("tvm")

from dlfp.backends.mlc.model_dir import CONFIG_NAME, ModelFolderError  # noqa: E402
from dlfp.backends.mlc.step import MLCStepBackend, StepConfig  # noqa: E402
from dlfp.backends.mlc.tokenizer import ByteTokenizer  # noqa: E402
from dlfp.protocol import BackendError, DecodeItem, Limits, PrefillChunk, StepPlan  # noqa: E402
from dlfp.paper import PaperDLFP  # noqa: E402
from dlfp.policy import Unbounded  # noqa: E402
from dlfp.tail import TailParams  # noqa: E402
from dlfp.engine import Engine, EngineConfig  # noqa: E402
from dlfp.sequence import BACKGROUND, FOREGROUND, Request  # noqa: E402

PROMPT = list(b"The lighthouse keeper climbed the stairs at dusk.")
OTHER = list(b"Bread rises because yeast eats sugar and breathes out gas.")


@pytest.fixture(scope="session")
def tiny_mlc(tmp_path_factory):
    """The tiny MLC-named model, compiled once per session (about 10 s on two cores)."""
    from dlfp.backends.mlc.build_tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("mlc") / "tiny", seed=0).path


@pytest.fixture(scope="module")
def backend(tiny_mlc):
    b = MLCStepBackend(StepConfig(str(tiny_mlc), Limits(4, 1024, 128), n_threads=1))
    yield b
    b.close()


def prefill(backend, seq, ids, chunk=None):
    """Prefill `ids` into slot `seq` (in chunks of `chunk`); returns the last logits."""
    chunk = chunk or len(ids)
    out = None
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        last = start + len(part) == len(ids)
        out = backend.step(StepPlan(prefills=[PrefillChunk(seq, part, start, last)])).logits.get(seq)
    return out


def greedy(backend, ids, n, seq=0):
    backend.free_sequence(seq)
    out = [int(prefill(backend, seq, ids).argmax())]
    for i in range(n - 1):
        r = backend.step(StepPlan(decodes=[DecodeItem(seq, out[-1], len(ids) + i)]))
        out.append(int(r.logits[seq].argmax()))
    backend.free_sequence(seq)
    return out


def test_capabilities_follow_the_config(backend):
    c = backend.capabilities
    assert c.owned_loop and c.multi_sequence and c.per_step_chunking
    assert (c.max_sequences, c.context_per_sequence, c.max_batch_tokens, c.vocab_size) == (4, 1024, 128, 264)
    assert backend.describe()["runtime"].startswith("apache-tvm")


def test_chunked_prefill_matches_whole_prefill(backend):
    whole = prefill(backend, 0, PROMPT)
    chunked = prefill(backend, 1, PROMPT, chunk=7)
    np.testing.assert_allclose(chunked, whole, atol=1e-4)
    assert whole.shape == (264,) and np.isfinite(whole).all()
    backend.free_sequence(0)
    backend.free_sequence(1)


def test_greedy_output_is_not_degenerate(backend):
    out = greedy(backend, PROMPT, 12)
    assert len(set(out)) > 3


def test_batched_decode_and_mixed_step_match_single_sequences(backend):
    ref_a, ref_b = greedy(backend, PROMPT, 6), greedy(backend, OTHER, 6)
    # Sequence 0 decodes while sequence 1's prompt arrives in chunks beside it, in the same calls.
    out_a = [int(prefill(backend, 0, PROMPT).argmax())]
    out_b, pos_b = [], 0
    for i in range(5):
        chunk = OTHER[pos_b : pos_b + 20]
        plan = StepPlan(decodes=[DecodeItem(0, out_a[-1], len(PROMPT) + i)])
        if chunk:
            plan.prefills.append(PrefillChunk(1, chunk, pos_b, pos_b + len(chunk) == len(OTHER)))
        elif out_b:
            plan.decodes.append(DecodeItem(1, out_b[-1], len(OTHER) + len(out_b) - 1))
        r = backend.step(plan)
        assert r.duration_s > 0
        out_a.append(int(r.logits[0].argmax()))
        pos_b += len(chunk)
        if 1 in r.logits:
            out_b.append(int(r.logits[1].argmax()))
    while len(out_b) < 6:
        r = backend.step(StepPlan(decodes=[DecodeItem(1, out_b[-1], len(OTHER) + len(out_b) - 1)]))
        out_b.append(int(r.logits[1].argmax()))
    assert out_a == ref_a and out_b == ref_b
    backend.free_sequence(0)
    backend.free_sequence(1)


def test_rewinding_a_sequence_recomputes_from_the_given_position(backend):
    ref = prefill(backend, 2, PROMPT)
    backend.free_sequence(2)
    prefill(backend, 2, PROMPT[:30] + [1, 2, 3])
    again = backend.step(StepPlan(prefills=[PrefillChunk(2, PROMPT[30:], 30, True)])).logits[2]
    np.testing.assert_allclose(again, ref, atol=1e-4)
    backend.free_sequence(2)


@pytest.mark.parametrize(
    "plan, message",
    [
        (StepPlan(prefills=[PrefillChunk(0, [1] * 129, 0, True)]), "exceeds max_batch_tokens"),
        (StepPlan(decodes=[DecodeItem(0, 1, 0)], prefills=[PrefillChunk(0, [1], 0, True)]), "twice"),
        (StepPlan(prefills=[PrefillChunk(0, [999], 0, True)]), "outside the vocabulary"),
        (StepPlan(prefills=[PrefillChunk(9, [1], 0, True)]), "slot 9"),
        (StepPlan(decodes=[DecodeItem(0, 1, 1024)]), "end of its context"),
        (StepPlan(prefills=[PrefillChunk(0, [1, 2], 5, True)]), "starts at 5"),
        (StepPlan(), "empty"),
    ],
)
def test_bad_steps_are_refused_with_one_clear_error(backend, plan, message):
    backend.free_sequence(0)
    with pytest.raises(BackendError, match=message):
        backend.step(plan)
    backend.free_sequence(0)


def test_bad_model_folders_fail_with_one_clear_error(tmp_path, tiny_mlc):
    with pytest.raises(ModelFolderError, match="not found"):
        MLCStepBackend(StepConfig(str(tmp_path / "nope")))
    with pytest.raises(ModelFolderError, match=CONFIG_NAME):
        MLCStepBackend(StepConfig(str(tmp_path)))
    cfg = json.loads((tiny_mlc / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match="model.so"):
        MLCStepBackend(StepConfig(str(tmp_path)))


def test_tokenizer_round_trips_text_and_renders_chatml(backend):
    text = "naïve café — 3 €"
    ids = backend.tokenize(text)
    assert len(ids) == len(text.encode()) and backend.detokenize(ids) == text
    chat = backend.apply_chat_template([{"role": "user", "content": "hi"}])
    assert backend.token_bytes(chat, special=True) == b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert backend.is_eos(257) and not backend.is_eos(ord("a"))
    with pytest.raises(ValueError, match=">= 256"):
        ByteTokenizer({"<x>": 12}, [], None)


def run_engine(backend, policy, budget):
    engine = Engine(backend, policy, EngineConfig(preemption_budget_s=budget)).start()
    bg = [engine.submit(Request(OTHER * 4, 3, BACKGROUND, request_id=f"bg{i}")) for i in range(2)]
    fg = engine.submit(Request(PROMPT, 24, FOREGROUND, ignore_eos=True, request_id="fg"))
    records = {h.request_id: h.result(timeout=120) for h in [*bg, fg]}
    engine.shutdown(abort_pending=False)
    return engine, records


def test_engine_outputs_identical_under_unbounded_and_dlfp(backend):
    _, unb = run_engine(backend, Unbounded(), None)
    engine, dl = run_engine(backend, PaperDLFP(TailParams(0.005, 8, 2, 64, 2)), 0.05)
    assert all(r.ok for r in [*unb.values(), *dl.values()])
    assert {k: r.output_ids for k, r in unb.items()} == {k: r.output_ids for k, r in dl.items()}
    assert len(dl["fg"].output_ids) == 24
    # Under DLFP the prompt chunks beside the foreground decode stay under the controller's cap.
    guarded = [s for s in engine.trace.steps if s.guarded and s.n_prefill_bg]
    assert guarded and all(s.n_prefill_bg <= 64 for s in guarded)


def test_kept_prefix_matches_a_cold_prefill_and_the_engine_reuses_it(backend):
    assert backend.capabilities.prefix_reuse
    turn2 = PROMPT + OTHER[:10]
    ref = prefill(backend, 3, turn2)
    backend.free_sequence(3)
    prefill(backend, 3, PROMPT + [7, 7, 7])  # a previous turn whose tail differs
    assert backend.keep_prefix(3, len(PROMPT)) and not backend.keep_prefix(3, len(PROMPT) + 1)
    again = backend.step(StepPlan(prefills=[PrefillChunk(3, OTHER[:10], len(PROMPT), True)])).logits[3]
    np.testing.assert_allclose(again, ref, atol=1e-4)
    assert backend.keep_prefix(3, 0) and backend.keep_prefix(3, 0)  # nothing held: nothing to keep
    backend.free_sequence(3)

    def chat(reuse):
        engine = Engine(backend, Unbounded(), EngineConfig(preemption_budget_s=None, prefix_reuse=reuse)).start()
        prompt, records = list(PROMPT), []
        try:
            for t in range(3):
                records.append(engine.submit(Request(list(prompt), 5, ignore_eos=True)).result(60))
                prompt += records[-1].output_ids + OTHER[t * 8 : t * 8 + 8]
        finally:
            engine.shutdown()
        return records

    warm, cold = chat(True), chat(False)
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
    assert [r.cached_prompt_tokens for r in warm] == [0, len(PROMPT) + 4, len(PROMPT) + 4 + 13]
    assert all(r.cached_prompt_tokens == 0 for r in cold)


def test_registry_loads_step_mode_from_the_profile(tiny_mlc):
    from dlfp.targets import load_backend
    from dlfp.profiles import load_profile

    b = load_backend("mlc", str(tiny_mlc), load_profile("cpu-laptop"), n_threads=1)
    prof = load_profile("cpu-laptop")
    assert b.capabilities.max_sequences == prof.max_sequences and b.capabilities.max_batch_tokens == prof.max_batch_tokens
    with pytest.raises(ValueError, match="needs --model"):
        load_backend("mlc", None, prof)


try:  # the shared conformance suite (backends/conformance.py)
    from dlfp.backends import conformance
except ImportError:  # pragma: no cover - only before the suite exists
    conformance = None


@pytest.mark.skipif(conformance is None, reason="dlfp.backends.conformance is not available")
@pytest.mark.parametrize("check", conformance.CHECKS if conformance else [], ids=lambda c: c.name)
def test_conformance_suite(backend, check):
    result = conformance.run_check(check, backend)
    expected = conformance.PASS if check.applies_to(backend.capabilities) else conformance.SKIP
    assert result.status == expected, result.detail


def test_laptop_job_runs_on_the_mlc_backend(tiny_mlc, tmp_path):
    """`dlfp laptop --backend mlc` end to end, functional only (timing is a benchmark's job)."""
    from click.testing import CliRunner

    from dlfp.cli import main

    out = tmp_path / "run"
    args = ["laptop", "--backend", "mlc", "--model", str(tiny_mlc), "--turns", "1", "--max-docs", "1",
            "--itl-target-ms", "20", "--threads", "1", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exact_output_match"] is True and summary["backend"]["name"] == "mlc"
    for p in summary["policies"].values():
        assert p["requests_failed"] == 0 and p["bg_docs_done"] == 1 and p["fg_turns_done"] == 1


def test_dlight_schedule_keeps_the_plain_pipelines_logits(tiny_mlc, tmp_path):
    """The default build (fused transpose-matmuls, dlight CPU rules) computes what apache-tvm's
    plain pipeline does: same weights, same logits (prefill, batched decode)."""
    from dlfp.backends.mlc.build_tiny import build_tiny

    plain = build_tiny(tmp_path / "plain", seed=0, schedule="none").path
    assert json.loads((tiny_mlc / CONFIG_NAME).read_text())["built_with"]["schedule"] == "dlight"
    assert json.loads((plain / CONFIG_NAME).read_text())["built_with"]["schedule"] == "none"
    rows = {}
    for name, folder in (("dlight", tiny_mlc), ("none", plain)):
        b = MLCStepBackend(StepConfig(str(folder), Limits(2, 256, 64), n_threads=1))
        try:
            a = prefill(b, 0, PROMPT)
            prefill(b, 1, OTHER)
            r = b.step(StepPlan(decodes=[DecodeItem(0, 7, len(PROMPT)), DecodeItem(1, 9, len(OTHER))]))
            rows[name] = np.stack([a, r.logits[0], r.logits[1]])
        finally:
            b.close()
    spread = np.ptp(rows["none"], axis=1).min()
    assert spread > 0
    assert np.abs(rows["dlight"] - rows["none"]).max() <= 1e-4 * spread


def test_unknown_schedule_is_refused(tmp_path):
    from dlfp.backends.mlc.build_tiny import build_tiny

    with pytest.raises(ValueError, match="schedule 'fast'"):
        build_tiny(tmp_path / "x", seed=0, schedule="fast")
