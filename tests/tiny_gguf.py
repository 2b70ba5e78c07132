"""Write a tiny random-weight llama-architecture GGUF for tests (well under a second)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_tiny_gguf(
    path: Path,
    vocab: int = 256,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 128,
    context: int = 2048,
    seed: int = 0,
    chat_template: str | None = None,
    n_head_kv: int | None = None,
    tied: bool = False,
    rope_theta: float | None = None,
    qtype: str = "F32",
    norm_jitter: bool = False,
) -> Path:
    """`n_head_kv` < n_head: grouped-query attention; `tied`: no output.weight (SmolLM2's
    layout); `qtype` "Q8_0": matrices stored quantised, as real GGUFs store them;
    `norm_jitter`: norm weights near 1 instead of 1, so a misplaced one shows."""
    import gguf

    rng = np.random.default_rng(seed)

    def w(out_dim: int, in_dim: int) -> np.ndarray:
        # 1/sqrt(fan_in): std 0.02 makes greedy decoding repeat one token.
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(context)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    n_head_kv = n_head_kv or n_head
    head_dim = n_embd // n_head
    writer.add_head_count_kv(n_head_kv)
    if rope_theta is not None:
        writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"tok{i}" for i in range(max(0, vocab - len(tokens)))]
    tokens = tokens[:vocab] if vocab >= 259 else tokens
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    writer.add_token_types(types[: len(tokens)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    n_vocab = len(tokens)

    def matrix(name: str, arr: np.ndarray) -> None:
        if qtype == "F32":
            writer.add_tensor(name, arr)
        else:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)

    def norm() -> np.ndarray:
        if not norm_jitter:
            return np.ones(n_embd, dtype=np.float32)
        return (1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)

    matrix("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", norm())
    if not tied:
        matrix("output.weight", w(n_vocab, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        matrix(f"blk.{i}.attn_q.weight", w(n_embd, n_embd))
        matrix(f"blk.{i}.attn_k.weight", w(n_head_kv * head_dim, n_embd))
        matrix(f"blk.{i}.attn_v.weight", w(n_head_kv * head_dim, n_embd))
        matrix(f"blk.{i}.attn_output.weight", w(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        matrix(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        matrix(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        matrix(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
