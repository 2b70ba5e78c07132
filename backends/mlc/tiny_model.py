"""A tiny Llama-style model whose compiled functions carry MLC-LLM's names.

The functions and their signatures follow MLC-LLM's model definitions
(`python/mlc_llm/model/llama/llama_model.py`): `embed(input_ids)`,
`batch_prefill(input_embeds, logit_positions, paged_kv_cache)`,
`batch_decode(input_embeds, paged_kv_cache)` and
`create_tir_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size,
page_size, support_sliding_window)`, all with packed parameters. The attention
runs on TVM's own paged KV cache (`tvm.relax.frontend.nn.llm.kv_cache`), so a
step mixes sequences exactly as MLC's engine does. Built with apache-tvm from
the registry: a close stand-in for MLC's own TVM build, not the same thing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tvm import relax, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 264  # 256 bytes + special tokens, padded to a multiple of 8
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: int = 10000
    context_window_size: int = 4096

    def to_dict(self) -> dict:
        return asdict(self)


class _MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class _Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        self.cfg = cfg
        width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        c = self.cfg
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, c.num_attention_heads + 2 * c.num_key_value_heads, c.head_dim))
        # RoPE is applied inside the cache (RopeMode.NORMAL) from each token's cached position.
        out = kv.attention_with_fused_qkv(layer_id, qkv, c.num_attention_heads, sm_scale=c.head_dim**-0.5)
        return self.o_proj(op.reshape(out, (b, s, c.num_attention_heads * c.head_dim)))


class _Layer(nn.Module):
    def __init__(self, cfg: TinyConfig):
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv, layer_id)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyConfig, target: Target):
        self.cfg = cfg
        self.target = target
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _forward(self, embeds: Tensor, kv: PagedKVCache) -> Tensor:
        h = embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, kv, i)
        return self.norm(h)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    def batch_prefill(self, input_embeds: Tensor, logit_positions: Tensor, paged_kv_cache: PagedKVCache):
        # All sequences' tokens ride in one ragged row; only the asked-for positions reach lm_head.
        h = op.take(self._forward(input_embeds, paged_kv_cache), logit_positions, axis=1)
        return self.lm_head(h), paged_kv_cache

    def batch_decode(self, input_embeds: Tensor, paged_kv_cache: PagedKVCache):
        return self.lm_head(self._forward(input_embeds, paged_kv_cache)), paged_kv_cache

    def create_tir_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        c = self.cfg
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=c.rope_theta,
            rope_scaling={},
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=c.head_dim,
            enable_disaggregation=False,
            dtype="float32",
            target=self.target,
        )

    def spec(self) -> nn.spec.ModuleSpec:
        h = self.cfg.hidden_size
        packed = {"param_mode": "packed", "effect_mode": "none"}
        kv = nn.spec.Object(object_type=PagedKVCache)
        raw = {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "batch_prefill": {
                "input_embeds": nn.spec.Tensor([1, "seq_len", h], "float32"),
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "paged_kv_cache": kv,
                "$": packed,
            },
            "batch_decode": {
                "input_embeds": nn.spec.Tensor(["batch_size", 1, h], "float32"),
                "paged_kv_cache": kv,
                "$": packed,
            },
            "create_tir_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        return nn.spec.ModuleSpec.from_raw(raw, self)
