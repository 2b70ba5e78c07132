"""The torch backend on CPU: correctness against transformers, chunking, policies, async mode and its timing.

The tiny config (Qwen3's architecture at toy size, fp32) runs everything here; the
conformance suite runs on it from tests/test_conformance.py.
"""
import json
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dlfp.protocol import BackendError, DecodeItem, PrefillChunk, StepPlan  # noqa: E402
from dlfp.backends.torch.backend import PLACEHOLDER, TorchBackend  # noqa: E402
from dlfp.backends.torch.config import ModelConfig, bundled_config  # noqa: E402
from dlfp.backends.torch.model import CausalLM  # noqa: E402

# fp32 on CPU: chunked and whole prefill differ only by float reordering in matmuls and softmax.
CHUNK_TOL = 1e-4  # of the logits' spread (max - min); the conformance suite allows 2e-2


def make(cfg="tiny", folder=None, n_seq=4, n_ctx=512, n_batch=128, seed=0) -> TorchBackend:
    config = cfg if isinstance(cfg, ModelConfig) else ModelConfig.load(cfg)
    return TorchBackend(config, folder, n_seq=n_seq, n_ctx=n_ctx, n_batch=n_batch, device="cpu", dtype="float32",
                        seed=seed, n_threads=1)


def prompt(n, seed=1, vocab=259):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def greedy(b, slot, ids, steps, chunk=None):
    """Prefill `ids` (in chunks of `chunk`) then decode greedily; return (first logits, tokens)."""
    b.free_sequence(slot)
    chunk = chunk or len(ids)
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        res = b.step(StepPlan(prefills=[PrefillChunk(slot, part, s, s + len(part) == len(ids))]))
    first = res.logits[slot].copy()
    toks = [int(np.argmax(first))]
    for i in range(steps - 1):
        res = b.step(StepPlan(decodes=[DecodeItem(slot, toks[-1], len(ids) + i)]))
        toks.append(int(np.argmax(res.logits[slot])))
    return first, toks


# -- the model against an independent implementation ------------------------------

@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_logits_match_transformers(arch):
    transformers = pytest.importorskip("transformers")
    d = bundled_config("tiny") | {"architectures": [arch], "model_type": arch.removesuffix("ForCausalLM").lower()}
    hf_cls = getattr(transformers, arch, None)
    if hf_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    hf_cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{k: v for k, v in d.items() if k != "_comment"})
    hf = hf_cls(hf_cfg).eval()
    b = make(ModelConfig.from_dict(d))
    missing, unexpected = hf.load_state_dict(b.model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    ids = prompt(21)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    # ours: a chunk of 7, a chunk of 13 (logits at position 19), then a decode at 20
    b.step(StepPlan(prefills=[PrefillChunk(0, ids[:7], 0, False)]))
    got19 = b.step(StepPlan(prefills=[PrefillChunk(0, ids[7:20], 7, True)])).logits[0]
    got20 = b.step(StepPlan(decodes=[DecodeItem(0, ids[20], 20)])).logits[0]
    np.testing.assert_allclose(got19, ref[19], atol=1e-4)
    np.testing.assert_allclose(got20, ref[20], atol=1e-4)


def test_bundled_configs_are_the_paper_models():
    # Non-embedding parameters as the model cards give them: 0.44B and 6.95B.
    for name, non_embedding in (("qwen3-0.6b", 0.44e9), ("qwen3-8b", 6.95e9)):
        cfg = ModelConfig.load(name)
        with torch.device("meta"):
            m = CausalLM(cfg)
        n = sum(p.numel() for n_, p in m.named_parameters() if "embed_tokens" not in n_ and "lm_head" not in n_)
        assert abs(n - non_embedding) / non_embedding < 0.01, (name, n)
        assert cfg.qk_norm and cfg.num_kv_heads == 8 and cfg.vocab_size == 151936


# -- chunking, isolation, device sampling -------------------------------------------

def test_chunked_prefill_equals_whole_prefill():
    b = make(n_batch=256)
    ids = prompt(150)
    whole, t_whole = greedy(b, 0, ids, 8)
    for chunk in (1, 7, 64):
        part, t_part = greedy(b, 1, ids, 8, chunk)
        spread = whole.max() - whole.min()
        assert np.max(np.abs(part - whole)) <= CHUNK_TOL * spread, chunk
        assert t_part == t_whole, chunk


def test_device_tokens_are_the_greedy_tokens_and_packing_is_isolated():
    b = make()
    a_ids, c_ids = prompt(40, 2), prompt(90, 3)
    _, solo_a = greedy(b, 0, a_ids, 6)
    b.free_sequence(0)
    b.step(StepPlan(prefills=[PrefillChunk(0, a_ids, 0, True)]))
    b.free_sequence(2)
    res = b.step(StepPlan(prefills=[PrefillChunk(2, c_ids[:30], 0, False)]))
    tok = solo_a[0]
    got = [tok]
    for i in range(5):  # slot 2's prompt rides along in every decode step
        res = b.step(StepPlan(decodes=[DecodeItem(0, tok, 40 + i)],
                              prefills=[PrefillChunk(2, c_ids[30 + 10 * i:40 + 10 * i], 30 + 10 * i, True)]))
        assert res.token_ids == {s: int(np.argmax(row)) for s, row in res.logits.items()}
        tok = res.token_ids[0]
        got.append(tok)
    assert got == solo_a


def test_async_launch_gives_the_sync_tokens():
    """Step k+1 is launched (placeholder decode tokens) before step k's results are collected."""
    b = make()
    prompts = {0: prompt(33, 4), 1: prompt(57, 5)}
    sync = {s: greedy(b, s, p, 10)[1] for s, p in prompts.items()}
    for s in prompts:
        b.free_sequence(s)
    pending = b.launch(StepPlan(prefills=[PrefillChunk(s, p, 0, True) for s, p in prompts.items()]))
    tokens = {s: [] for s in prompts}
    for k in range(9):
        nxt = b.launch(StepPlan(decodes=[DecodeItem(s, PLACEHOLDER, len(p) + k) for s, p in prompts.items()]))
        res = pending.wait()  # collected only after the next step is queued
        for s, t in res.token_ids.items():
            tokens[s].append(t)
        pending = nxt
    for s, t in pending.wait().token_ids.items():
        tokens[s].append(t)
    assert tokens == sync


def test_bad_plans_are_refused_with_a_message():
    b = make()
    with pytest.raises(BackendError, match="placeholder"):
        b.step(StepPlan(decodes=[DecodeItem(0, PLACEHOLDER, 0)]))
    b.step(StepPlan(prefills=[PrefillChunk(0, [5, 6, 7], 0, True)]))
    with pytest.raises(BackendError, match="twice"):
        b.step(StepPlan(decodes=[DecodeItem(0, 5, 3)], prefills=[PrefillChunk(0, [5], 3, True)]))
    with pytest.raises(BackendError, match="only 3 are filled"):
        b.step(StepPlan(decodes=[DecodeItem(0, 5, 9)]))
    with pytest.raises(BackendError, match="vocabulary"):
        b.step(StepPlan(decodes=[DecodeItem(0, 259, 3)]))
    assert b.step(StepPlan(decodes=[DecodeItem(0, 5, 3)])).logits[0].shape == (259,)  # still serving


# -- weights from a Hugging Face folder ---------------------------------------------

def test_safetensors_folder_loads_the_same_model(tmp_path):
    save_file = pytest.importorskip("safetensors.torch").save_file

    ref = make(seed=3)
    state = {k: v.contiguous() for k, v in ref.model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(bundled_config("tiny")))
    loaded = make(ModelConfig.load(tmp_path), folder=tmp_path, seed=99)
    assert loaded.weights.startswith("safetensors")
    ids = prompt(30)
    assert greedy(ref, 0, ids, 4)[1] == greedy(loaded, 0, ids, 4)[1]
    np.testing.assert_array_equal(greedy(ref, 0, ids, 1)[0], greedy(loaded, 0, ids, 1)[0])
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        make(ModelConfig.load(tmp_path), folder=tmp_path)


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dict(bundled_config("tiny") | {"architectures": ["MixtralForCausalLM"]})


# -- through the engine --------------------------------------------------------------

def test_greedy_outputs_are_exact_between_policies():
    from dlfp.controller import parse_policy
    from dlfp.tail import TailParams
    from dlfp.engine import Engine, EngineConfig
    from dlfp.sequence import Request, SamplingParams

    b = make(n_batch=64)
    params = TailParams(0.002, 8, 1, 64, 1)  # a target the tiny model misses: the cap moves
    outputs = {}
    for policy in ("unbounded", "fixed:8", "dlfp", "dlfp-cadence"):
        eng = Engine(b, parse_policy(policy, params), EngineConfig(preemption_budget_s=0.002)).start()
        handles = [eng.submit(Request(prompt(n, seed), 12, prio, SamplingParams(temperature=0.0), True, f"r{seed}"))
                   for n, seed, prio in ((40, 1, "foreground"), (200, 2, "background"), (120, 3, "foreground"))]
        outputs[policy] = {h.request_id: h.result(60).output_ids for h in handles}
        eng.shutdown()
        assert all(len(ids) == 12 for ids in outputs[policy].values()), policy
    assert all(o == outputs["unbounded"] for o in outputs.values())


# -- async (pipelined) mode through the engine ----------------------------------------

def _run_engine(b, policy, requests):
    from dlfp.controller import parse_policy
    from dlfp.tail import TailParams
    from dlfp.engine import Engine, EngineConfig

    eng = Engine(b, parse_policy(policy, TailParams(0.002, 8, 1, 64, 1)), EngineConfig(preemption_budget_s=0.002)).start()
    try:
        handles = [eng.submit(r) for r in requests()]
        return {h.request_id: h.result(120) for h in handles}, eng.trace
    finally:
        eng.shutdown()


def _requests():
    from dlfp.sequence import Request, SamplingParams

    shapes = ((40, 1, "foreground", 12), (200, 2, "background", 6), (120, 3, "foreground", 9), (30, 4, "foreground", 1))
    return [Request(prompt(n, seed), out, prio, SamplingParams(temperature=0.0), True, f"r{seed}")
            for n, seed, prio, out in shapes]


def test_async_mode_gives_the_sync_tokens_and_really_pipelines():
    b = make(n_batch=64)
    events = []
    launch, collect = b.launch, b._collect
    b.launch = lambda plan: (events.append("launch"), launch(plan))[1]
    b._collect = lambda launched: (events.append("wait"), collect(launched))[1]
    for policy in ("unbounded", "dlfp", "dlfp-cadence"):
        b.pipelined = False
        sync, _ = _run_engine(b, policy, _requests)
        b.pipelined = True
        events.clear()
        asyn, trace = _run_engine(b, policy, _requests)
        assert {k: r.output_ids for k, r in asyn.items()} == {k: r.output_ids for k, r in sync.items()}, policy
        assert all(r.finish_reason == "length" and len(r.output_ids) == r_out
                   for r, r_out in zip(asyn.values(), (12, 6, 9, 1))), policy
        # Step k+1 was launched before step k was collected: two launches in a row.
        assert any(a == b_ == "launch" for a, b_ in zip(events, events[1:])), policy
        assert len(trace.steps) == events.count("wait")


def test_async_mode_refuses_sampling_it_cannot_do():
    from dlfp.policy import Unbounded
    from dlfp.engine import Engine, InvalidRequest
    from dlfp.sequence import Request, SamplingParams

    b = make()
    b.pipelined = True
    eng = Engine(b, Unbounded()).start()
    try:
        with pytest.raises(InvalidRequest, match="greedily"):
            eng.submit(Request(prompt(10), 4, sampling=SamplingParams(temperature=0.7)))
    finally:
        eng.shutdown()


def test_explicit_mask_fallback_gives_the_same_logits(monkeypatch):
    from dlfp.backends.torch import model as model_mod

    ids = prompt(60)
    ref = make()
    ref.step(StepPlan(prefills=[PrefillChunk(0, ids[:20], 0, False)]))
    want = ref.step(StepPlan(prefills=[PrefillChunk(0, ids[20:], 20, True)])).logits[0]

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for this bias")

    monkeypatch.setattr(model_mod, "causal_lower_right", refuse)
    monkeypatch.setattr(model_mod, "_LOWER_RIGHT_OK", True)
    b = make()
    b.step(StepPlan(prefills=[PrefillChunk(0, ids[:20], 0, False)]))
    got = b.step(StepPlan(prefills=[PrefillChunk(0, ids[20:], 20, True)])).logits[0]
    assert model_mod._LOWER_RIGHT_OK is False
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_async_mode_with_eos_and_slot_reuse_matches_sync():
    """Sequences stop on EOS while a step that decodes them is already in flight, and their
    slots are reused at once: the stale tokens are dropped and nobody else's change."""
    from dlfp.sequence import Request, SamplingParams

    def requests():
        return [Request(prompt(20 + 13 * i, 10 + i), 16, "foreground" if i % 2 else "background",
                        SamplingParams(temperature=0.0), False, f"e{i}") for i in range(6)]

    b = make(n_seq=2, n_batch=64)
    b.is_eos = lambda token: token % 5 == 0  # some outputs end early, at points the tokens decide
    b.pipelined = False
    sync, _ = _run_engine(b, "dlfp", requests)
    b.pipelined = True
    asyn, _ = _run_engine(b, "dlfp", requests)
    assert {k: (r.output_ids, r.finish_reason) for k, r in asyn.items()} == {
        k: (r.output_ids, r.finish_reason) for k, r in sync.items()}
    assert {r.finish_reason for r in sync.values()} == {"stop", "length"}  # both endings exercised


# -- async timing: each step's own time, never the next launch's -----------------------

class SlowPrefill:
    """The model, with `seconds` more work in every step that carries a prompt chunk of 2+ tokens."""

    def __init__(self, model, seconds):
        self.model, self.seconds = model, seconds

    def __call__(self, batch, cache, rope):
        out = self.model(batch, cache, rope)
        if any(s.length > 1 for s in batch.segments):
            time.sleep(self.seconds)
        return out


def test_an_async_step_is_timed_without_the_step_launched_after_it():
    b = make()
    b.step(StepPlan(prefills=[PrefillChunk(0, prompt(20), 0, True)]))
    b.model = SlowPrefill(b.model, 0.25)
    decode = b.launch(StepPlan(decodes=[DecodeItem(0, PLACEHOLDER, 20)]))
    prefill = b.launch(StepPlan(prefills=[PrefillChunk(1, prompt(64, 2), 0, True)]))  # launched before the wait
    fast, slow = decode.wait(), prefill.wait()
    assert slow.duration_s >= 0.25
    assert fast.duration_s < 0.1, f"the decode step was timed with the prefill launched after it: {fast.duration_s:.3f} s"


def test_a_pipelined_engine_feeds_the_backends_own_step_times():
    """The engine collects step k after launching step k+1: what it records and the policy
    observes is the step's own duration as the backend measured it, not a host clock there."""
    b = make(n_batch=64)
    b.model = SlowPrefill(b.model, 0.03)
    measured = []
    collect = b._collect
    b._collect = lambda launched: (lambda r: (measured.append(r.duration_s), r)[1])(collect(launched))
    b.pipelined = True
    _, trace = _run_engine(b, "dlfp", _requests)
    assert [s.duration_s for s in trace.steps] == measured
    guarded = [s for s in trace.steps if s.guarded]
    fed = [s for s in guarded if s.observed_s is not None]  # what the policy observed (current epoch)
    assert fed and all(s.observed_s == s.duration_s for s in fed)
