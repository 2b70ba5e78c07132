"""GGUF models through the exporters: one reader (gguf_weights), two backends, checked
against a torch fp32 reference and llama.cpp on the same file (`dlfp check-model`).

The GGUF here is tiny but shaped like SmolLM2's: grouped-query attention, a tied
head (no output.weight), a non-default RoPE theta, Q8_0 matrices, norms not all one.
"""
import json

import numpy as np
import pytest

from dlfp.protocol import Limits

from tiny_gguf import CHATML, write_tiny_gguf

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

TINY = dict(vocab=512, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, tied=True, rope_theta=50000.0,
            qtype="Q8_0", norm_jitter=True, chat_template=CHATML)


@pytest.fixture(scope="session")
def llama_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-llama") / "tiny-llama.gguf", **TINY)


@pytest.fixture(scope="module")
def llama(llama_gguf):
    pytest.importorskip("llama_cpp")
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig

    b = LlamaCppBackend(LlamaCppConfig(str(llama_gguf), Limits(2, 512, 512), n_threads=1))
    yield b
    b.close()


# -- the shared reader ---------------------------------------------------------
def test_reader_gives_config_and_dequantised_weights(llama_gguf):
    from dlfp.backends import gguf_weights

    cfg, weights = gguf_weights.load(llama_gguf)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 512)
    assert cfg.tied_embeddings and cfg.rope_theta == 50000.0 and cfg.num_layers == 2
    assert weights["blk.0.attn_k.weight"].shape == (32, 64) and weights["token_embd.weight"].dtype == np.float32
    assert "output.weight" not in weights
    # Q8_0 keeps ~8 bits: the dequantised matrix is close to, not equal to, a float one.
    assert 0 < np.abs(weights["blk.1.ffn_up.weight"]).max() < 10


def test_rotate_half_undoes_llamacpp_qk_permutation():
    from dlfp.backends.gguf_weights import LlamaConfig, rotate_half_qk

    cfg = LlamaConfig("t", 8, 16, 32, 1, 4, 2, 4, 1e4, 1e-5, 64, True)
    rng = np.random.default_rng(0)
    hf = {"blk.0.attn_q.weight": rng.standard_normal((16, 16)), "blk.0.attn_k.weight": rng.standard_normal((8, 16))}

    def llamacpp_permute(w, heads):  # what llama.cpp's converter does to HF's rotate-half rows
        return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    stored = {"blk.0.attn_q.weight": llamacpp_permute(hf["blk.0.attn_q.weight"], 4),
              "blk.0.attn_k.weight": llamacpp_permute(hf["blk.0.attn_k.weight"], 2)}
    back = rotate_half_qk(stored, cfg)
    for k in hf:
        assert np.array_equal(back[k], hf[k])


def _write(path, arch="llama", extra_tensor=None, scaling=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    if scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reader_refuses_what_it_cannot_run(tmp_path):
    from dlfp.backends import gguf_weights

    with pytest.raises(gguf_weights.GGUFModelError, match="architecture 'qwen2' is not supported"):
        gguf_weights.load(_write(tmp_path / "q.gguf", arch="qwen2"))
    with pytest.raises(gguf_weights.GGUFModelError, match="RoPE scaling"):
        gguf_weights.load(_write(tmp_path / "s.gguf", scaling=True))
    with pytest.raises(gguf_weights.GGUFModelError, match="no place for"):
        gguf_weights.load(_write(tmp_path / "b.gguf", extra_tensor="blk.0.attn_q.bias"))
    (tmp_path / "x.gguf").write_bytes(b"nope")
    with pytest.raises(gguf_weights.GGUFModelError, match="bad magic"):
        gguf_weights.load(tmp_path / "x.gguf")


# -- the tokenizer beside the model ------------------------------------------------
def test_tokenizer_written_from_the_gguf_matches_llamacpp(llama_gguf, llama, tmp_path):
    from dlfp.backends.gguf_weights import write_tokenizer
    from dlfp.backends.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(write_tokenizer(llama_gguf, tmp_path / "tok"))
    msgs = [{"role": "user", "content": "Hello wörld, how are you?"}]
    assert tok.chat(msgs) == llama.apply_chat_template(msgs)
    text = "Ünïcode text and plain words"
    assert tok.encode(text) == llama.tokenize(text)  # BOS by llama.cpp's rule for this vocabulary
    assert tok.encode(text, add_special=False) == llama.tokenize(text, add_special=False)
    ids = llama.tokenize(text, add_special=False)
    assert tok.token_bytes(ids) == llama.token_bytes(ids) and tok.decode(ids) == llama.detokenize(ids)
    assert tok.eos_ids == {i for i in range(512) if llama.is_eos(i)}


@pytest.mark.model
def test_smollm2_tokenizer_matches_llamacpp(tmp_path):
    """The default GGUF's tokenizer, rebuilt by transformers, against llama.cpp's own."""
    pytest.importorskip("llama_cpp")
    from dlfp.backends.gguf_weights import write_tokenizer
    from dlfp.backends.hf_tokenizer import HFTokenizer
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
    from dlfp.models import default_model_path

    path = default_model_path()
    tok = HFTokenizer(write_tokenizer(path, tmp_path / "tok"))
    ll = LlamaCppBackend(LlamaCppConfig(str(path), Limits(1, 512, 512), n_threads=1))
    try:
        msgs = [{"role": "user", "content": "Héllo — name three rivers 🌊"}]
        assert tok.chat(msgs) == ll.apply_chat_template(msgs)
        text = "Some text with ümlauts and 🌊 emoji"
        ids = ll.tokenize(text)
        assert tok.encode(text) == ids and tok.token_bytes(ids) == ll.token_bytes(ids)
        assert tok.eos_ids == {i for i in range(tok.vocab_size) if ll.is_eos(i)}
    finally:
        ll.close()


# -- both exporters, checked -----------------------------------------------------------
def _check(backend, llama, gguf_path, ref_tol=1e-4):
    from dlfp.backends.check_model import run_check

    return run_check(backend, llama, gguf_path, "Say hello.", 10, ref_tol=ref_tol)


def test_mlc_build_from_gguf_matches_torch_and_llamacpp(llama_gguf, llama, tmp_path):
    pytest.importorskip("tvm")
    from dlfp.backends.mlc.build import build_gguf
    from dlfp.backends.mlc.step import MLCStepBackend, StepConfig

    folder = build_gguf(tmp_path / "mlc", llama_gguf, context=256)
    assert (folder.path / "tokenizer" / "tokenizer.json").is_file()
    assert folder.config["tokenizer"] == {"kind": "hf", "folder": "tokenizer"}
    backend = MLCStepBackend(StepConfig(str(folder.path), Limits(2, 256, 64),
                                        n_threads=1))
    try:
        result = _check(backend, llama, llama_gguf)
    finally:
        backend.close()
    assert result["prompt_ids_equal_llamacpp"]
    ref = result["vs_torch_fp32"]
    assert ref["passed"] and ref["max_share_of_spread"] < 1e-4 and ref["greedy_equal"]
    assert result["vs_llamacpp"]["passed"], result["vs_llamacpp"]


@pytest.fixture(scope="module")
def et_fp32(llama_gguf, tmp_path_factory):
    pytest.importorskip("executorch")
    import warnings

    from dlfp.backends.executorch_export import export_gguf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_gguf(llama_gguf, tmp_path_factory.mktemp("et") / "tiny.pte", max_seq_len=256, max_chunk=64,
                           dtype="fp32")


def test_executorch_export_from_gguf_matches_torch_and_llamacpp(et_fp32, llama, llama_gguf):
    from dlfp.backends.executorch import ExecuTorchBackend, ExecuTorchConfig

    meta = json.loads((et_fp32.parent / (et_fp32.name + ".json")).read_text())
    assert meta["tokenizer"] == {"kind": "hf", "folder": "tiny.pte.tokenizer"} and meta["model"]["dtype"] == "fp32"
    backend = ExecuTorchBackend(ExecuTorchConfig(str(et_fp32), Limits(2, 2048, 64), n_threads=1))
    try:
        result = _check(backend, llama, llama_gguf)
        assert backend.is_eos(2) and not backend.is_eos(3)
    finally:
        backend.close()
    assert result["prompt_ids_equal_llamacpp"]
    ref = result["vs_torch_fp32"]
    assert ref["passed"] and ref["max_share_of_spread"] < 1e-4 and ref["greedy_equal"]
    assert result["vs_llamacpp"]["passed"], result["vs_llamacpp"]


def test_export_refuses_a_context_past_the_model(llama_gguf, tmp_path):
    pytest.importorskip("executorch")
    from dlfp.backends.executorch_export import export_gguf

    with pytest.raises(ValueError, match="past the model's context"):
        export_gguf(llama_gguf, tmp_path / "x.pte", max_seq_len=4096)


def test_check_model_reports_a_wrong_model(llama_gguf, llama, tmp_path):
    """The check can fail: a GGUF with other weights is not the backend's model."""
    pytest.importorskip("tvm")
    from dlfp.backends.check_model import run_check
    from dlfp.backends.mlc.build import build_gguf
    from dlfp.backends.mlc.step import MLCStepBackend, StepConfig

    other = write_tiny_gguf(tmp_path / "other.gguf", **{**TINY, "seed": 1})
    folder = build_gguf(tmp_path / "mlc-other", other, context=256)
    backend = MLCStepBackend(StepConfig(str(folder.path), Limits(2, 256, 64)))
    try:
        result = run_check(backend, llama, llama_gguf, "Say hello.", 6)
    finally:
        backend.close()
    assert not result["vs_torch_fp32"]["passed"] and not result["passed"]


def test_mlc_step_mode_reads_mlc_llm_layout(llama_gguf, llama, tmp_path):
    """mlc-chat-config.json + tensor-cache.json + params shards + tokenizer files + one *.so, as
    `mlc_llm convert_weight`/`compile` lay them out (written here by our build: untested on real mlc_llm output)."""
    pytest.importorskip("tvm")
    from dlfp.backends.mlc.build import build_gguf
    from dlfp.backends.mlc.model_dir import ModelFolder, ModelFolderError
    from dlfp.backends.mlc.step import MLCStepBackend, StepConfig

    folder = build_gguf(tmp_path / "mlc", llama_gguf, context=256, layout="mlc", prefill_chunk_size=64)
    names = {f.name for f in folder.path.iterdir()}
    assert {"mlc-chat-config.json", "tensor-cache.json", "params_shard_0.bin", "tokenizer.json", "model.so"} <= names
    assert "dlfp-mlc.json" not in names and "dlfp-tokenizer.json" not in names
    backend = MLCStepBackend(StepConfig(str(folder.path), Limits(2, 256, 512),
                                        n_threads=1))
    try:
        assert backend.capabilities.max_batch_tokens == 64  # clamped to the compiled limit
        assert backend.describe()["clamped"] == ["max_batch_tokens 512 -> 64 (compiled limit)"]
        assert backend.is_eos(2) and not backend.is_eos(3)  # from mlc-chat-config.json's token ids
        result = _check(backend, llama, llama_gguf)
    finally:
        backend.close()
    assert result["passed"] and result["vs_torch_fp32"]["max_share_of_spread"] < 1e-4
    (folder.path / "extra.so").write_bytes(b"")
    with pytest.raises(ModelFolderError, match="2 compiled libraries"):
        ModelFolder.open(folder.path)


def test_executorch_int8_export_costs_little_accuracy(llama_gguf, llama, tmp_path):
    """--dtype int8: XNNPACK's dynamic int8 linear layers, checked with a looser tolerance."""
    pytest.importorskip("executorch")
    import warnings

    from dlfp.backends.executorch import ExecuTorchBackend, ExecuTorchConfig
    from dlfp.backends.executorch_export import export_gguf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pte = export_gguf(llama_gguf, tmp_path / "int8.pte", max_seq_len=256, max_chunk=64, dtype="int8")
    backend = ExecuTorchBackend(ExecuTorchConfig(str(pte), Limits(2, 2048, 64), n_threads=1))
    try:
        result = _check(backend, llama, llama_gguf, ref_tol=0.05)
    finally:
        backend.close()
    ref = result["vs_torch_fp32"]
    assert 1e-4 < ref["max_share_of_spread"] < 0.05  # quantised: not fp32-exact, but close
    assert ref["passed"] and result["vs_llamacpp"]["passed"], result


def test_export_command_defaults_to_fp32_packed_for_a_gguf(llama_gguf, tmp_path):
    """A GGUF exports fp32 in the packed layout unless told otherwise; --per-sequence keeps one Program each."""
    pytest.importorskip("executorch")
    from click.testing import CliRunner

    from dlfp.backends.executorch_export import export_command

    out = tmp_path / "m.pte"
    r = CliRunner().invoke(export_command, ["--gguf", str(llama_gguf), "--out", str(out), "--max-seq-len", "128",
                                            "--max-chunk", "32", "--slots", "2"])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "m.pte.json").read_text())
    assert meta["layout"] == "packed" and meta["slots"] == 2 and meta["model"]["dtype"] == "fp32"
    r = CliRunner().invoke(export_command, ["--gguf", str(llama_gguf), "--out", str(tmp_path / "s.pte"),
                                            "--max-seq-len", "128", "--max-chunk", "32", "--per-sequence"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "s.pte.json").read_text()).get("layout", "per-sequence") == "per-sequence"
