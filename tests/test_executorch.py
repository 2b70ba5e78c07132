"""ExecuTorch for real: the exported program, the adapter and its worker process."""
import json
import threading
import time
import warnings

import numpy as np
import pytest

pytest.importorskip("executorch")

from tiny_pte import TINY, tiny_pte  # noqa: E402

from dlfp.backends.executorch import ExecuTorchBackend, ExecuTorchConfig, ModelLoadError  # noqa: E402
from dlfp.protocol import BackendError, DecodeItem, Limits, PrefillChunk, StepPlan  # noqa: E402


@pytest.fixture(scope="module")
def pte(tmp_path_factory):
    return tiny_pte(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def backend(pte):
    b = ExecuTorchBackend(ExecuTorchConfig(str(pte), Limits(2, 2048, 160), n_threads=1))
    yield b
    b.close()


def _program(pte):
    from executorch.runtime import Runtime

    return Runtime.get().load_program(str(pte)).load_method("forward")


def test_pte_matches_eager_for_prefill_and_decode(pte):
    import torch

    from dlfp.backends.executorch_export import TinyConfig, build_model

    eager, method = build_model(TinyConfig(**TINY)), _program(pte)
    tokens = torch.randint(3, 259, (1, 37), generator=torch.Generator().manual_seed(1))
    calls = [(tokens[:, :20], 0), (tokens[:, 20:], 20), (tokens[:, :1], 37), (tokens[:, 1:2], 38)]
    with torch.no_grad():
        for toks, start in calls:  # chunked prefill, then two decodes, through one cache
            want = eager(toks, torch.tensor([start]))
            got = method.execute([toks, torch.tensor([start])])[0]
            assert got.shape == (1, TINY.get("vocab", 259))
            assert torch.allclose(got, want, atol=1e-4), (start, (got - want).abs().max())


def test_sidecar_records_tokenizer_and_limits(pte):
    meta = json.loads((pte.parent / "tiny.pte.json").read_text())
    assert meta["max_seq_len"] == TINY["max_seq_len"] and meta["max_chunk"] == TINY["max_chunk"]
    assert meta["tokenizer"]["kind"] == "bytes"


def test_capabilities_come_from_the_program(backend):
    c = backend.capabilities
    assert c.owned_loop and c.multi_sequence and c.per_step_chunking
    assert c.context_per_sequence == TINY["max_seq_len"] and c.max_batch_tokens == TINY["max_chunk"]
    assert c.vocab_size == 259 and c.max_sequences == 2
    assert backend.describe()["executorch"] == "1.5.1"


def test_tokenizer_round_trip_and_chat_template(backend):
    text = "héllo, wörld"
    ids = backend.tokenize(text)
    assert ids[0] == 1 and backend.detokenize(ids) == text
    chat = backend.apply_chat_template([{"role": "user", "content": "hi {there}"}])
    assert backend.detokenize(chat) == "<|user|>\nhi {there}\n<|assistant|>\n"
    assert backend.is_eos(2) and not backend.is_eos(3)


def test_greedy_output_is_not_one_repeated_token(backend):
    ids = backend.tokenize("The quick brown fox jumps over the lazy dog.")
    r = backend.step(StepPlan(prefills=[PrefillChunk(0, ids, 0, True)]))
    out = [int(r.logits[0].argmax())]
    for i in range(7):
        out.append(int(backend.step(StepPlan(decodes=[DecodeItem(0, out[-1], len(ids) + i)])).logits[0].argmax()))
    backend.free_sequence(0)
    assert len(set(out)) > 2, out


def test_engine_thread_keeps_the_gil_free(backend, pte):
    """A long step in the worker leaves other threads running; in-process execute() would not."""

    n_steps = 10

    def blocked_share(run_steps) -> float:
        """The share of the run the ticker spent in gaps of at least half a step: most of it
        where each step holds the GIL. (Not the longest gap: on a loaded machine a thread is
        sometimes descheduled for a few ms whatever the GIL does, and a step here is a few ms.)"""
        ticks, stop = [], threading.Event()

        def ticker():
            while not stop.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0.0005)

        t = threading.Thread(target=ticker)
        t.start()
        t0 = time.perf_counter()
        step_s = run_steps()
        t1 = time.perf_counter()
        stop.set()
        t.join()
        # The run's own ends bound the gaps: a ticker the run never let in ticked not at all.
        gaps = np.diff([t0] + [x for x in ticks if t0 < x < t1] + [t1])
        return float(gaps[gaps >= 0.5 * step_s].sum() / (t1 - t0))

    ids = (backend.tokenize("a long prompt " * 20, add_special=False))[: TINY["max_chunk"]]

    def via_worker():
        t0 = time.perf_counter()
        for _ in range(n_steps):
            backend.free_sequence(1)
            backend.step(StepPlan(prefills=[PrefillChunk(1, ids, 0, True)]))
        return (time.perf_counter() - t0) / n_steps

    import torch

    method = _program(pte)

    def in_process():
        t0 = time.perf_counter()
        for _ in range(n_steps):
            method.execute([torch.tensor([ids]), torch.tensor([0])])
        return (time.perf_counter() - t0) / n_steps

    assert blocked_share(in_process) > 0.7  # execute() holds the GIL for the whole call ...
    assert blocked_share(via_worker) < 0.3  # ... which is why the adapter uses a worker process


def test_bad_plans_are_refused_before_the_runtime(backend):
    ids = backend.tokenize("abc")
    with pytest.raises(BackendError, match="gap"):
        backend.step(StepPlan(prefills=[PrefillChunk(0, ids, 5, True)]))
    with pytest.raises(BackendError, match="twice"):
        backend.step(StepPlan(decodes=[DecodeItem(0, 5, 0)], prefills=[PrefillChunk(0, ids, 0, True)]))
    with pytest.raises(BackendError, match="vocabulary"):
        backend.step(StepPlan(prefills=[PrefillChunk(0, [300], 0, True)]))


def test_load_errors_are_one_clear_line(tmp_path, pte):
    with pytest.raises(ModelLoadError, match="not found"):
        ExecuTorchBackend(ExecuTorchConfig(str(tmp_path / "none.pte")))
    bogus = tmp_path / "bogus.pte"
    bogus.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not an ExecuTorch"):
        ExecuTorchBackend(ExecuTorchConfig(str(bogus)))
    lone = tmp_path / "lone.pte"
    lone.write_bytes(pte.read_bytes())
    with pytest.raises(ModelLoadError, match="sidecar"):
        ExecuTorchBackend(ExecuTorchConfig(str(lone)))


def test_etdump_durations_and_a_dead_worker(pte):
    b = ExecuTorchBackend(ExecuTorchConfig(str(pte), Limits(1, 2048, 256), n_threads=1, etdump=True))
    try:
        ids = b.tokenize("ETDump times each execute inside the runtime. " * 2)
        r = b.step(StepPlan(prefills=[PrefillChunk(0, ids, 0, True)]))
        assert r.device_duration_s is not None
        # ExecuTorch's own span of Method::execute lies inside the worker's wall time around it.
        assert 0.3 * r.duration_s < r.device_duration_s <= r.duration_s
        b._proc.kill()
        b._proc.join(5)
        with pytest.raises(BackendError, match="died"):
            b.step(StepPlan(decodes=[DecodeItem(0, 5, len(ids))]))
    finally:
        b.close()


def test_export_command_rejects_bad_sizes(tmp_path):
    from click.testing import CliRunner

    from dlfp.cli import main

    r = CliRunner().invoke(main, ["export-executorch", "--out", str(tmp_path / "x.pte"), "--vocab", "10"])
    assert r.exit_code != 0 and "--vocab" in r.output


def test_engine_runs_a_chat_on_the_pte(backend):
    from dlfp.policy import FixedCap
    from dlfp.engine import Engine, EngineConfig
    from dlfp.sequence import BACKGROUND, Request

    engine = Engine(backend, FixedCap(16), EngineConfig(preemption_budget_s=None)).start()
    fg = engine.submit(Request(backend.apply_chat_template([{"role": "user", "content": "hi"}]), 12, ignore_eos=True))
    bg = engine.submit(Request(backend.tokenize("x" * 150), 2, BACKGROUND, ignore_eos=True))
    rec_fg, rec_bg = fg.result(120), bg.result(120)
    engine.shutdown()
    assert rec_fg.ok and rec_bg.ok and len(rec_fg.output_ids) == 12
    capped = [s for s in engine.trace.steps if s.guarded and s.n_prefill_bg]
    assert capped and all(s.n_prefill_bg <= 16 for s in capped)
