"""Read a Llama-family GGUF for the exporters: config, dequantised weights, tokenizer.

One reader for every exporter (`dlfp export-executorch --gguf`, the MLC
`build --gguf`), so both backends run exactly the weights llama.cpp runs from
the same file, dequantised to float32 with `gguf.quants`.

Supported: `general.architecture == "llama"` with plain RoPE (SmolLM, Llama 1/2/3.0,
TinyLlama, Mistral-style GGUFs written as "llama"); tied or separate output head;
grouped-query attention. Refused with a clear error: other architectures, RoPE
scaling, and any tensor this decoder has no place for (biases, `rope_freqs`).

Q/K layout: llama.cpp's converter permutes the query and key rows of each head so
that RoPE rotates adjacent pairs (x[2i], x[2i+1]). A model whose RoPE rotates
halves (x[i], x[i + d/2]), as Hugging Face's and TVM's do, needs them un-permuted
(`rotate_half_qk`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)
GGUF_MAGIC = b"GGUF"
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


class GGUFModelError(ValueError):
    """The file is not a GGUF this reader can turn into a model."""


@dataclass(frozen=True)
class LlamaConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tied_embeddings: bool  # no output.weight: the head reuses token_embd

    def to_dict(self) -> dict:
        return asdict(self)


def resolve(value: str | os.PathLike) -> Path:
    """A GGUF path from the command line; 'default' is the bundled SmolLM2 (dlfp.models)."""
    if str(value) == "default":
        from dlfp.models import default_model_path

        return default_model_path()
    return Path(value)


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over the file (memory-mapped), after a magic check."""
    p = Path(path)
    if not p.is_file():
        raise GGUFModelError(f"GGUF file not found: {p}")
    with open(p, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFModelError(f"not a GGUF file (bad magic): {p}")
    try:
        import gguf
    except ImportError:
        raise GGUFModelError("reading a GGUF needs the `gguf` package (pip install gguf)") from None
    return gguf.GGUFReader(str(p))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFModelError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFModelError(f"RoPE scaling {scaling!r} is not supported (plain RoPE only)")

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    if heads % kv_heads or head_dim % 2:
        raise GGUFModelError(f"{heads} heads over {kv_heads} KV heads of size {head_dim}: not a shape this decoder runs")
    rope_dims = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFModelError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    return LlamaConfig(
        name=str(_field(reader, "general.name", "") or ""),
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        context_length=int(need("context_length")),
        tied_embeddings="output.weight" not in names,
    )


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder takes, by GGUF name, as [out, in] (torch's Linear layout)."""
    d, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_embeddings:
        out["output.weight"] = (cfg.vocab_size, d)
    per_layer = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
                 "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    for i in range(cfg.num_layers):
        for name, shape in per_layer.items():
            out[f"blk.{i}.{name}.weight"] = shape
    return out


def read_weights(reader, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Every tensor dequantised to float32, by GGUF name, shapes checked; Q/K as llama.cpp stores them."""
    from gguf.quants import dequantize

    want = expected_shapes(cfg)
    have = {t.name: t for t in reader.tensors}
    extra = sorted(set(have) - set(want))
    if extra:
        raise GGUFModelError(f"GGUF has tensors this Llama decoder has no place for: {extra[:4]}")
    missing = sorted(set(want) - set(have))
    if missing:
        raise GGUFModelError(f"GGUF lacks tensors: {missing[:4]}")
    out = {}
    for name, shape in want.items():
        t = have[name]
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, order="C")  # own, writable copy
        if tuple(arr.shape) != shape:
            raise GGUFModelError(f"{name}: shape {tuple(arr.shape)}, expected {shape}")
        out[name] = arr
    return out


def rotate_half_qk(weights: dict[str, np.ndarray], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Undo llama.cpp's Q/K row permutation, for a RoPE that rotates halves (HF, TVM)."""
    out = dict(weights)
    for i in range(cfg.num_layers):
        for name, heads in (("attn_q", cfg.num_heads), ("attn_k", cfg.num_kv_heads)):
            key = f"blk.{i}.{name}.weight"
            w = weights[key]
            # GGUF row order within a head is (pair i, half h); rotate-half wants (half h, pair i).
            out[key] = np.ascontiguousarray(
                w.reshape(heads, cfg.head_dim // 2, 2, w.shape[-1]).swapaxes(1, 2).reshape(w.shape))
    return out


def load(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    reader = open_gguf(path)
    cfg = read_config(reader)
    return cfg, read_weights(reader, cfg)


def write_tokenizer(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """The GGUF's tokenizer and chat template as a Hugging Face tokenizer folder (tokenizer.json, ...).

    transformers rebuilds the fast tokenizer from the GGUF's vocabulary and merges;
    the backends then load it with `tokenizers` alone (hf_tokenizer.HFTokenizer).
    """
    p = Path(path).resolve()
    open_gguf(p)  # the magic check, before transformers' own less clear errors
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise GGUFModelError("writing the tokenizer needs `transformers` (pip install transformers)") from None
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as exc:  # transformers raises many kinds for a tokenizer it cannot convert
        raise GGUFModelError(f"transformers could not build the tokenizer from {p.name}: {exc}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    from dlfp.backends.hf_tokenizer import write_eog

    reader = open_gguf(p)
    write_eog(out, eog_ids(reader), source=p.name, bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
              add_bos=add_bos(reader))
    return out


def add_bos(reader) -> bool:
    """Whether llama.cpp prepends BOS when asked for special tokens: the GGUF's flag, else its default
    (yes for SentencePiece-style "llama" vocabularies, no for BPE ones)."""
    flag = _field(reader, "tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    return _field(reader, "tokenizer.ggml.model") == "llama"


def eog_ids(reader) -> list[int]:
    """The ids that end a generation, as llama.cpp decides them for this file (eos, eot, eom, known texts)."""
    from dlfp.backends.hf_tokenizer import EOG_TEXTS

    ids = {int(v) for k in ("eos", "eot", "eom") if (v := _field(reader, f"tokenizer.ggml.{k}_token_id")) is not None}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    ids |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    return sorted(ids)
