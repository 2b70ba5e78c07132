"""The packed ExecuTorch layout: one Program, one execute per step, every sequence in it.

Each check compares against the per-sequence layout (one Program per slot) or the
eager decoder, which share one decoder definition and one seed: same weights.
"""
import json

import numpy as np
import pytest

pytest.importorskip("executorch")

from tiny_pte import PACKED_SLOTS, TINY, tiny_packed_pte, tiny_pte  # noqa: E402

from dlfp.backends.executorch import ExecuTorchBackend, ExecuTorchConfig  # noqa: E402
from dlfp.protocol import BackendError, DecodeItem, Limits, PrefillChunk, StepPlan  # noqa: E402

# fp32 on both sides; the packed call sums attention over more (masked) cells and
# batches the matmuls differently, so results agree to rounding, not bit for bit.
ATOL = 1e-4


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    b = ExecuTorchBackend(ExecuTorchConfig(str(tiny_packed_pte(tmp_path_factory.getbasetemp())),
                                           Limits(PACKED_SLOTS, 2048, 160), n_threads=1))
    yield b
    b.close()


@pytest.fixture(scope="module")
def per_seq(tmp_path_factory):
    b = ExecuTorchBackend(ExecuTorchConfig(str(tiny_pte(tmp_path_factory.getbasetemp())),
                                           Limits(PACKED_SLOTS, 2048, 160), n_threads=1))
    yield b
    b.close()


def _ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def _reference(prompt: list[int], follow: list[int]) -> list[np.ndarray]:
    """Eager decoder, one sequence alone: logits after the prompt, then after each decode."""
    import torch

    from dlfp.backends.executorch_export import TinyConfig, build_model

    model = build_model(TinyConfig(**TINY))
    with torch.no_grad():
        out = [model(torch.tensor([prompt]), torch.tensor([0]))[0].numpy()]
        for i, tok in enumerate(follow):
            out.append(model(torch.tensor([[tok]]), torch.tensor([len(prompt) + i]))[0].numpy())
    return out


def test_sidecar_records_layout_and_delegation(tmp_path_factory):
    meta = json.loads((tiny_packed_pte(tmp_path_factory.getbasetemp()).parent / "tiny-packed4.pte.json").read_text())
    assert meta["layout"] == "packed" and meta["slots"] == PACKED_SLOTS
    d = meta["delegation"]
    # XNNPACK takes the linear layers; the cache writes and the mask stay on portable kernels.
    assert d["delegated_ops"] > 0 and d["delegated_subgraphs"] >= 7 * TINY["layers"]
    assert "aten_index_put_default" in d["portable_by_op"]


def test_packed_lowers_sequences_to_its_slots(tmp_path_factory):
    b = ExecuTorchBackend(ExecuTorchConfig(str(tiny_packed_pte(tmp_path_factory.getbasetemp())),
                                           Limits(PACKED_SLOTS + 1, 2048, 160), n_threads=1))
    try:
        assert b.capabilities.max_sequences == PACKED_SLOTS
        with pytest.raises(BackendError, match="outside"):
            b.step(StepPlan(prefills=[PrefillChunk(PACKED_SLOTS, [5, 6], 0, True)]))
    finally:
        b.close()


def test_mixed_step_matches_per_sequence(packed, per_seq):
    """Two decodes and one chunk in one execute give the per-sequence layout's logits."""
    a, b, c = _ids(20, 1), _ids(15, 2), _ids(32, 3)
    plans = [
        StepPlan(prefills=[PrefillChunk(0, a, 0, True), PrefillChunk(1, b, 0, True)]),
        StepPlan(decodes=[DecodeItem(0, 7, 20), DecodeItem(1, 9, 15)], prefills=[PrefillChunk(2, c, 0, True)]),
        StepPlan(decodes=[DecodeItem(0, 8, 21), DecodeItem(1, 10, 16)], prefills=[PrefillChunk(2, c[:5], 32, False)]),
    ]
    for plan in plans:
        got, want = packed.step(plan), per_seq.step(plan)
        assert sorted(got.logits) == sorted(want.logits)
        for slot in want.logits:
            assert np.abs(got.logits[slot] - want.logits[slot]).max() < ATOL, slot
    for b_ in (packed, per_seq):
        for slot in range(3):
            b_.free_sequence(slot)


def test_a_sequence_is_untouched_by_its_neighbours(packed):
    """Slot 0 decodes while slot 1 prefills, is freed and reused by another prompt: its logits
    stay those of the sequence alone."""
    prompt, follow = _ids(25, 4), [5, 6, 7, 8]
    want = _reference(prompt, follow)
    r = packed.step(StepPlan(prefills=[PrefillChunk(0, prompt, 0, True), PrefillChunk(1, _ids(40, 5), 0, True)]))
    got = [r.logits[0]]
    neighbours = [
        [PrefillChunk(1, _ids(30, 6), 40, False)],  # slot 1 prefills further
        [PrefillChunk(1, _ids(12, 7), 0, True)],  # slot 1 freed and reused, stale cells past 12
        [PrefillChunk(1, _ids(3, 8), 12, True), PrefillChunk(3, _ids(50, 9), 0, True)],
        [],
    ]
    for i, (tok, others) in enumerate(zip(follow, neighbours)):
        if i == 1:
            packed.free_sequence(1)
        r = packed.step(StepPlan(decodes=[DecodeItem(0, tok, len(prompt) + i)], prefills=others))
        got.append(r.logits[0])
    for slot in (0, 1, 3):
        packed.free_sequence(slot)
    for g, w in zip(got, want):
        assert np.abs(g - w).max() < ATOL


def _engine_outputs(backend) -> list[list[int]]:
    from dlfp.policy import FixedCap
    from dlfp.engine import Engine, EngineConfig
    from dlfp.sequence import BACKGROUND, Request

    engine = Engine(backend, FixedCap(16), EngineConfig(preemption_budget_s=None)).start()
    handles = [
        engine.submit(Request(backend.apply_chat_template([{"role": "user", "content": "hi"}]), 12, ignore_eos=True)),
        engine.submit(Request(backend.apply_chat_template([{"role": "user", "content": "hello there"}]), 10,
                              ignore_eos=True)),
        engine.submit(Request(backend.tokenize("x" * 150), 4, BACKGROUND, ignore_eos=True)),
    ]
    records = [h.result(120) for h in handles]
    engine.shutdown()
    assert all(r.ok for r in records)
    return [list(r.output_ids) for r in records]


def test_engine_greedy_outputs_equal_between_layouts(packed, per_seq):
    assert _engine_outputs(packed) == _engine_outputs(per_seq)


def test_describe_names_the_layout(packed, per_seq):
    assert packed.describe()["layout"] == "packed" and per_seq.describe()["layout"] == "per-sequence"


def test_export_command_refuses_one_slot(tmp_path):
    from click.testing import CliRunner

    from dlfp.cli import main

    r = CliRunner().invoke(main, ["export-executorch", "--out", str(tmp_path / "x.pte"), "--packed", "--slots", "1"])
    assert r.exit_code != 0 and "--slots" in r.output


def test_int8_packed_export_runs_close_to_fp32(tmp_path):
    """The real-model default (dynamic int8 linear layers) lowers the packed forward too."""
    import warnings
    from pathlib import Path

    import torch
    from executorch.runtime import Runtime

    from dlfp.backends.executorch_export import TinyConfig, build_model, export_pte

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pte, _ = export_pte(build_model(TinyConfig(**TINY, slots=2)), Path(tmp_path) / "i8.pte",
                            TINY["max_chunk"], "int8", slots=2)
    method = Runtime.get().load_program(str(pte)).load_method("forward")
    tokens = torch.tensor([_ids(20, 11)])
    with torch.no_grad():
        want = build_model(TinyConfig(**TINY))(tokens, torch.tensor([0]))[0]
    got = method.execute([tokens, torch.full((20,), 1), torch.arange(20), torch.tensor([19])])[0][0]
    assert ((got - want).norm() / want.norm()).item() < 0.05  # int8 weights and activations: ~1.4 % here


def test_packed_bench_times_what_the_program_holds():
    """scripts/et_packed_bench.py: each timed step needs a free slot for its chunk."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "et_packed_bench.py"
    spec = importlib.util.spec_from_file_location("et_packed_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.decoder_counts(5) == (1, 2, 4)
    assert bench.decoder_counts(8) == (1, 2, 4)
    assert bench.decoder_counts(4) == (1, 2, 3)
    assert bench.decoder_counts(2) == (1,)
    with pytest.raises(SystemExit):
        bench.decoder_counts(1)
