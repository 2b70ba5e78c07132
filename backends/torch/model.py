"""A decoder-only causal LM (Llama/Qwen3 family) over a packed step and a per-slot KV cache.

Parameter names follow Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so
a checkpoint's safetensors load as they are. One forward runs every token of a step
(decodes and prompt chunks of several sequences, packed in one row dimension): the
projections and MLP run once over all of them; attention runs per sequence against
that sequence's slot of the preallocated cache.

Attention per sequence, without copying the cache:
- a decode (one query) groups the query heads of each KV head along the query axis,
  so grouped-query attention is plain attention over the cache slice;
- a prompt chunk expands the KV heads (compute-bound anyway) and uses a lower-right
  causal mask: query i of a chunk starting at position s sees positions <= s + i.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from dlfp.backends.torch.config import ModelConfig

log = logging.getLogger("dlfp.backends.torch")
_LOWER_RIGHT_OK = True  # False once SDPA has refused a lower-right causal bias on this machine
_RMS_NORM = getattr(F, "rms_norm", None)  # torch >= 2.4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 as the reference implementations do, whatever the weights' dtype;
        # F.rms_norm (one op where torch fuses it) when this torch has it.
        if _RMS_NORM is not None:
            return self.weight * _RMS_NORM(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryTable:
    """cos/sin per position (Hugging Face's half-rotation layout), built once for the context."""

    def __init__(self, head_dim: int, theta: float, n_positions: int, device: torch.device):
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
        angles = torch.outer(torch.arange(n_positions, dtype=torch.float64, device=device), inv)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions, [N, 1, head_dim]: gathered once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [N, heads, head_dim] rotated by its rows' positions."""
        cos, sin = cos_sin
        h = x.float()
        half = h.shape[-1] // 2
        rotated = torch.cat([-h[..., half:], h[..., :half]], dim=-1)
        return (h * cos + rotated * sin).to(x.dtype)


@dataclass
class Segment:
    """The rows of one sequence in a packed step."""

    slot: int
    row: int  # first row in the packed batch
    length: int
    start: int  # position of the first row


@dataclass
class Packed:
    tokens: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slots: torch.Tensor  # [N] long
    segments: list[Segment]
    logit_rows: torch.Tensor  # [R] rows whose next-token logits are wanted


class KVCache:
    """Keys and values per layer, [slots, kv_heads, positions, head_dim], allocated once."""

    def __init__(self, cfg: ModelConfig, n_slots: int, n_positions: int, dtype: torch.dtype, device: torch.device):
        shape = (n_slots, cfg.num_kv_heads, n_positions, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(self, x: torch.Tensor, batch: Packed, cos_sin: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryTable.apply(q, cos_sin), RotaryTable.apply(k, cos_sin)
        k_cache[batch.slots, :, batch.positions] = k  # every new key/value into its slot at once
        v_cache[batch.slots, :, batch.positions] = v
        out = torch.empty_like(q)
        for seg in batch.segments:
            rows = slice(seg.row, seg.row + seg.length)
            out[rows] = self._attend(q[rows], k_cache[seg.slot], v_cache[seg.slot], seg)
        return self.o_proj(out.view(n, -1))

    def _attend(self, q: torch.Tensor, k_slot: torch.Tensor, v_slot: torch.Tensor, seg: Segment) -> torch.Tensor:
        """q: [L, heads, dim] -> [L, heads, dim] against positions [0, start + L) of one slot."""
        end = seg.start + seg.length
        k, v = k_slot[:, :end], v_slot[:, :end]  # [kv_heads, T, dim], views
        group = self.n_heads // self.n_kv
        if seg.length == 1:
            qg = q.view(self.n_kv, group, self.head_dim).unsqueeze(0)  # heads of one KV head share its keys
            o = F.scaled_dot_product_attention(qg, k.unsqueeze(0), v.unsqueeze(0))
            return o.view(1, self.n_heads, self.head_dim)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        q4, k4, v4 = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        global _LOWER_RIGHT_OK
        if _LOWER_RIGHT_OK:
            try:  # lets SDPA pick a fused kernel (flash when the chunk starts at 0, else mem-efficient)
                o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal_lower_right(seg.length, end))
                return o.squeeze(0).transpose(0, 1)
            except RuntimeError as exc:  # no kernel for it here: an explicit mask always works
                _LOWER_RIGHT_OK = False
                log.warning("lower-right causal bias unavailable (%s); using an explicit mask", exc)
        mask = torch.ones(seg.length, end, dtype=torch.bool, device=q.device).tril(diagonal=seg.start)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)
        return o.squeeze(0).transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: Packed, cache: KVCache, rope: RotaryTable) -> torch.Tensor:
        """Next-token logits (float32) for `batch.logit_rows`, in that order; fills the cache."""
        h = self.model.embed_tokens(batch.tokens)
        cos_sin = rope.at(batch.positions)
        for i, layer in enumerate(self.model.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), batch, cos_sin, cache.k[i], cache.v[i])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = self.model.norm(h[batch.logit_rows])
        return self.lm_head(last).float()


def init_random_(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights from a seed, like vLLM's load_format="dummy": for timing, not text.

    Normal(0, std) matrices (Hugging Face's initializer_range) and unit norms, so
    activations stay in range through every layer in bf16.
    """
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
