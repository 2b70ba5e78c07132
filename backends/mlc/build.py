"""Build an MLC step-mode model folder from a Llama-family GGUF (real weights and tokenizer).

    python -m dlfp.backends.mlc.build OUT --gguf FILE|default [--context 2048] [--layout dlfp|mlc]

Reads the GGUF with `gguf_weights` (the reader `dlfp export-executorch --gguf`
shares), compiles the Llama model of `tiny_model` at the GGUF's shape with
apache-tvm for the CPU, and writes the folder `model_dir` describes with the
dequantised float32 weights and the GGUF's tokenizer (`tokenizer/`). TVM's RoPE
rotates halves, so the Q/K rows llama.cpp permuted are put back first. Tens of
seconds for SmolLM2-135M.

`--layout mlc` writes MLC-LLM's own layout instead (mlc-chat-config.json, a
tensor-cache.json over params_shard_*.bin, the tokenizer files at the top, the
library as model.so): the layout model_dir reads from `mlc_llm compile` output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from dlfp.backends.mlc.build_tiny import add_schedule_option, compile_model, write_folder
from dlfp.backends.mlc.model_dir import ModelFolder

TOKENIZER_DIR = "tokenizer"


def mlc_config(cfg, context: int):
    """tiny_model's config at the GGUF model's shape."""
    from dlfp.backends.mlc.tiny_model import TinyConfig

    return TinyConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                      context_window_size=context)


def mlc_weights(cfg, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF-named arrays -> tiny_model's parameters (fused QKV and gate/up, rotate-half Q/K)."""
    from dlfp.backends.gguf_weights import rotate_half_qk

    w = rotate_half_qk(weights, cfg)
    out = {"embed_tokens.weight": w["token_embd.weight"], "norm.weight": w["output_norm.weight"],
           # A tied head is stored twice here (the compiled lm_head takes its own parameter).
           "lm_head.weight": w.get("output.weight", w["token_embd.weight"])}
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate([w[b + "attn_q.weight"], w[b + "attn_k.weight"],
                                                               w[b + "attn_v.weight"]])
        out[p + "self_attn.o_proj.weight"] = w[b + "attn_output.weight"]
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate([w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"]])
        out[p + "mlp.down_proj.weight"] = w[b + "ffn_down.weight"]
        out[p + "input_layernorm.weight"] = w[b + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = w[b + "ffn_norm.weight"]
    return out


def build_gguf(out: str | Path, gguf_path: str | Path, context: int = 2048, layout: str = "dlfp",
               prefill_chunk_size: int = 2048, schedule: str = "dlight") -> ModelFolder:
    from dlfp.backends import gguf_weights

    if layout not in ("dlfp", "mlc"):
        raise ValueError(f"layout {layout!r}: choose dlfp or mlc")
    cfg, weights = gguf_weights.load(gguf_path)
    if not 1 <= context <= cfg.context_length:
        raise ValueError(f"--context {context} must be in 1..{cfg.context_length} (the model's context)")
    out = Path(out)
    mcfg = mlc_config(cfg, context)
    params = mlc_weights(cfg, weights)
    model = {"architecture": "llama", "gguf": str(Path(gguf_path).resolve()), **cfg.to_dict()}
    if layout == "mlc":
        return _write_mlc_layout(out, gguf_path, mcfg, params, model, prefill_chunk_size, schedule)
    gguf_weights.write_tokenizer(gguf_path, out / TOKENIZER_DIR)
    shapes = compile_model(mcfg, out, schedule)
    return write_folder(out, mcfg, shapes, params, {"kind": "hf", "folder": TOKENIZER_DIR}, model,
                        "dequantised float32 from the GGUF", schedule)


def _write_mlc_layout(out: Path, gguf_path, mcfg, params: dict, model: dict, prefill_chunk_size: int,
                      schedule: str = "dlight") -> ModelFolder:
    """MLC-LLM's folder layout with this build's library and float32 weights (MLC would name it q0f32)."""
    import json

    from tvm.contrib.tvmjs import dump_tensor_cache

    from dlfp.backends import gguf_weights
    from dlfp.backends.hf_tokenizer import DLFP_TOKENIZER
    from dlfp.backends.mlc.model_dir import MLC_CONFIG_NAME

    import contextlib
    import io

    shapes = compile_model(mcfg, out, schedule)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per shard
        dump_tensor_cache([(name, params[name]) for name, _ in shapes], str(out), encode_format="raw",
                          show_progress=False)
    gguf_weights.write_tokenizer(gguf_path, out)
    tok = json.loads((out / DLFP_TOKENIZER).read_text())
    (out / DLFP_TOKENIZER).unlink()  # MLC keeps token ids in mlc-chat-config.json instead
    (out / MLC_CONFIG_NAME).write_text(json.dumps({
        "model_type": "llama",
        "quantization": "q0f32",
        "model_config": {**mcfg.to_dict(), "tie_word_embeddings": model["tied_embeddings"]},
        "vocab_size": mcfg.vocab_size,
        "context_window_size": mcfg.context_window_size,
        "prefill_chunk_size": prefill_chunk_size,
        "max_batch_size": 80,
        "bos_token_id": tok["bos_id"],
        "eos_token_id": tok["eog_ids"],
        "conv_template": {"name": "chatml", "stop_token_ids": tok["eog_ids"]},
        "tokenizer_files": sorted(f.name for f in out.iterdir() if f.name.startswith("tokenizer")),
        "dlfp_note": f"written by dlfp's MLC build from {Path(gguf_path).name}, not by mlc_llm",
    }, indent=2) + "\n")
    return ModelFolder.open(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dlfp.backends.mlc.build", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write")
    ap.add_argument("--gguf", required=True, help="a Llama-family GGUF, or 'default' (the bundled SmolLM2)")
    ap.add_argument("--context", type=int, default=2048, help="positions per sequence (default 2048)")
    ap.add_argument("--layout", choices=("dlfp", "mlc"), default="dlfp",
                    help="dlfp's folder (default) or MLC-LLM's (mlc-chat-config.json + tensor cache)")
    add_schedule_option(ap)
    args = ap.parse_args(argv)
    try:
        from dlfp.backends.gguf_weights import resolve

        folder = build_gguf(args.out, resolve(args.gguf), args.context, args.layout, schedule=args.schedule)
    except (ValueError, OSError) as exc:
        print(f"build: {exc}", file=sys.stderr)
        return 2
    print(folder.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
