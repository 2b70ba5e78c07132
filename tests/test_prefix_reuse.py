"""Prefix reuse on the real llama.cpp backend (tiny random-weight GGUF): partial KV
removal gives the logits of a cold prefill, and the engine's outputs with reuse are
token for token those of the same requests run cold."""
import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from prefix_steps import cold, decode, prefill  # noqa: E402

from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig  # noqa: E402
from dlfp.protocol import Limits  # noqa: E402
from dlfp.policy import FixedCap, Unbounded  # noqa: E402
from dlfp.engine import Engine, EngineConfig  # noqa: E402
from dlfp.sequence import BACKGROUND, FOREGROUND, Request  # noqa: E402


@pytest.fixture(scope="module")
def backend(tiny_gguf):
    b = LlamaCppBackend(LlamaCppConfig(str(tiny_gguf), limits=Limits(3, 512, 128), n_threads=1))
    yield b
    b.close()


def ids(start, n):
    return [(start + 37 * i) % 400 + 50 for i in range(n)]


def test_backend_declares_prefix_reuse(backend):
    assert backend.capabilities.prefix_reuse


def test_reused_prefix_gives_the_logits_of_a_cold_prefill(backend):
    a = ids(1, 90)
    backend.free_sequence(0)
    out = decode(backend, 0, prefill(backend, 0, a), len(a), 8)  # KV: a + out[:-1]
    b = a + out + ids(5, 20)  # the next turn: previous prompt, the reply, a new message
    keep = len(a) + len(out) - 1
    assert backend.keep_prefix(0, keep)
    warm = prefill(backend, 0, b, start=keep)
    warm_out = decode(backend, 0, warm, len(b), 6)
    ref, ref_out = cold(backend, b)
    assert np.array_equal(warm, ref)  # bit-identical: the exact-output checks rest on it
    assert warm_out == ref_out


def test_shorter_second_prompt_and_divergence_at_token_zero(backend):
    a = ids(3, 120)
    backend.free_sequence(0)
    prefill(backend, 0, a)
    shorter = a[:40] + ids(9, 10)  # drops the tail of the cache from position 40
    assert backend.keep_prefix(0, 40)
    got = prefill(backend, 0, shorter, start=40)
    assert np.array_equal(got, cold(backend, shorter)[0])
    other = ids(200, 30)  # shares nothing: everything is dropped
    assert other[0] != shorter[0]
    assert backend.keep_prefix(0, 0)
    assert np.array_equal(prefill(backend, 0, other), cold(backend, other)[0])
    backend.free_sequence(0)


def chat(backend, reuse, policy_factory, with_doc=True, turns=4):
    """A four-turn chat whose every prompt extends the previous prompt and reply; a
    background document runs between the first turns and takes another slot."""
    engine = Engine(backend, policy_factory(), EngineConfig(preemption_budget_s=None, prefix_reuse=reuse)).start()
    try:
        prompt, records = ids(11, 60), []
        for t in range(turns):
            rec = engine.submit(Request(list(prompt), 8, FOREGROUND, request_id=f"turn-{t}")).result(60)
            records.append(rec)
            if t == 0 and with_doc:
                doc = engine.submit(Request(ids(300, 150), 4, BACKGROUND, request_id="doc")).result(60)
                records.append(doc)
            prompt = prompt + rec.output_ids + ids(40 + t, 12)
    finally:
        engine.shutdown()
    return records


@pytest.mark.parametrize("policy", [Unbounded, lambda: FixedCap(5)])
def test_engine_chat_with_reuse_matches_cold_token_for_token(backend, policy):
    warm = chat(backend, True, policy)
    cold_run = chat(backend, False, policy)
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold_run]
    assert all(r.ok for r in warm)
    by_id = {r.request_id: r for r in warm}
    assert by_id["turn-0"].cached_prompt_tokens == 0 and by_id["doc"].cached_prompt_tokens == 0
    for t in range(1, 4):  # the document used another slot; each turn reuses its conversation's
        prev = by_id[f"turn-{t - 1}"]
        assert by_id[f"turn-{t}"].cached_prompt_tokens == prev.prompt_len + len(prev.output_ids) - 1
    assert all(r.cached_prompt_tokens == 0 for r in cold_run)


def test_opt_out_request_prefills_everything(backend):
    engine = Engine(backend, Unbounded(), EngineConfig(preemption_budget_s=None)).start()
    try:
        p = ids(7, 50)
        first = engine.submit(Request(list(p), 4)).result(60)
        again = p + first.output_ids + ids(8, 5)
        warm = engine.submit(Request(list(again), 4)).result(60)
        opted_out = engine.submit(Request(list(again), 4, cache_prompt=False)).result(60)
    finally:
        engine.shutdown()
    assert warm.cached_prompt_tokens == len(p) + 3 and opted_out.cached_prompt_tokens == 0
    assert warm.output_ids == opted_out.output_ids
