"""Prefix reuse on ExecuTorch, both layouts (tiny random-weight programs): a kept prefix
plus the new suffix gives a cold prefill's logits, and the engine's outputs with reuse
are token for token those of the same requests run cold."""
import numpy as np
import pytest

pytest.importorskip("executorch")

from prefix_steps import cold, decode, prefill  # noqa: E402
from tiny_pte import tiny_packed_pte, tiny_pte  # noqa: E402

from dlfp.backends.executorch import ExecuTorchBackend, ExecuTorchConfig  # noqa: E402
from dlfp.protocol import Limits  # noqa: E402
from dlfp.policy import FixedCap, Unbounded  # noqa: E402
from dlfp.engine import Engine, EngineConfig  # noqa: E402
from dlfp.sequence import BACKGROUND, FOREGROUND, Request  # noqa: E402

TOL = 1e-4  # relative to the logits' spread: a chunk split differently may round differently


@pytest.fixture(scope="module", params=["per-sequence", "packed"])
def backend(request, tmp_path_factory):
    folder = tmp_path_factory.getbasetemp()
    pte = tiny_packed_pte(folder) if request.param == "packed" else tiny_pte(folder)
    b = ExecuTorchBackend(ExecuTorchConfig(str(pte), Limits(3, 512, 128), n_threads=1))
    yield b
    b.close()


def ids(start, n):
    return [(start + 37 * i) % 250 + 3 for i in range(n)]  # byte tokens, no specials


def close(a, b):
    return float(np.max(np.abs(a - b))) <= TOL * float(np.ptp(b))


def test_declared_and_a_kept_prefix_gives_the_logits_of_a_cold_prefill(backend):
    assert backend.capabilities.prefix_reuse
    a = ids(1, 90)
    backend.free_sequence(0)
    out = decode(backend, 0, prefill(backend, 0, a), len(a), 8)
    nxt = a + out + ids(5, 20)
    keep = len(a) + len(out) - 1
    assert backend.keep_prefix(0, keep)
    warm = prefill(backend, 0, nxt, start=keep)
    warm_out = decode(backend, 0, warm, len(nxt), 6)
    ref, ref_out = cold(backend, nxt)
    assert close(warm, ref) and warm_out == ref_out
    shorter = a[:40] + ids(9, 10)  # cells 40.. hold the old turn: masked, then rewritten
    assert backend.keep_prefix(0, 40)
    assert close(prefill(backend, 0, shorter, start=40), cold(backend, shorter)[0])
    other = ids(200, 30)
    assert backend.keep_prefix(0, 0)
    assert close(prefill(backend, 0, other), cold(backend, other)[0])
    assert not backend.keep_prefix(0, len(other) + 1)  # more than the slot holds
    backend.free_sequence(0)


def chat(backend, reuse, policy):
    engine = Engine(backend, policy(), EngineConfig(preemption_budget_s=None, prefix_reuse=reuse)).start()
    try:
        prompt, records = ids(11, 60), []
        for t in range(3):
            rec = engine.submit(Request(list(prompt), 6, FOREGROUND, request_id=f"turn-{t}", ignore_eos=True)).result(120)
            records.append(rec)
            if t == 0:
                records.append(engine.submit(Request(ids(90, 120), 3, BACKGROUND, request_id="doc",
                                                     ignore_eos=True)).result(120))
            prompt = prompt + rec.output_ids + ids(40 + t, 12)
    finally:
        engine.shutdown()
    return records


@pytest.mark.parametrize("policy", [Unbounded, lambda: FixedCap(5)], ids=["unbounded", "fixed5"])
def test_engine_chat_with_reuse_matches_cold_token_for_token(backend, policy):
    warm, cold_run = chat(backend, True, policy), chat(backend, False, policy)
    assert all(r.ok for r in warm + cold_run)
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold_run]
    by_id = {r.request_id: r for r in warm}
    for t in (1, 2):  # the document took another slot; each turn reuses its conversation's
        prev = by_id[f"turn-{t - 1}"]
        assert by_id[f"turn-{t}"].cached_prompt_tokens == prev.prompt_len + len(prev.output_ids) - 1
    assert all(r.cached_prompt_tokens == 0 for r in cold_run)
