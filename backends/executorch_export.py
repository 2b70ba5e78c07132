"""Build a `.pte` the ExecuTorch adapter can step: `dlfp export-executorch`.

The program has ONE method, `forward(tokens[1, L], start_pos[1]) -> logits[1, vocab]`,
with L dynamic (1..max_chunk) and the KV cache in mutable buffers, so the same
method serves a prefill chunk (L tokens at start_pos) and a decode (L = 1). The
logits are those of the chunk's last token. Linear layers are lowered to XNNPACK;
the cache update and attention mask run on ExecuTorch's portable kernels.

The model here is a tiny random-weight decoder (RMSNorm, RoPE, SwiGLU), enough to
exercise the runtime; a real model goes through the same `export_pte` as long as
its forward has that signature. A JSON sidecar (`<file>.pte.json`) carries what a
`.pte` does not: the tokenizer (byte-level here: the random model has none) and
the chat template.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

SIDECAR_SUFFIX = ".json"  # tiny.pte -> tiny.pte.json
SIDECAR_FORMAT = "dlfp-executorch/1"
N_SPECIAL = 3  # 0 pad, 1 bos, 2 eos; byte b is token b + N_SPECIAL
BYTE_VOCAB = N_SPECIAL + 256
CHAT_TEMPLATE = {"message": "<|{role}|>\n{content}\n", "generation_prompt": "<|assistant|>\n"}


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = BYTE_VOCAB
    dim: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 128
    max_seq_len: int = 4096  # positions one sequence may occupy (the cache length)
    max_chunk: int = 256  # largest L one call takes (sizes the activation arena)
    seed: int = 0

    def check(self) -> None:
        if self.vocab < BYTE_VOCAB:
            raise ValueError(f"--vocab must be at least {BYTE_VOCAB} (3 specials + 256 bytes)")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError("--dim must split into heads of even size")
        if not 2 <= self.max_chunk <= self.max_seq_len:
            raise ValueError("--max-chunk must be between 2 and --max-seq-len")


def build_model(cfg: TinyConfig):
    """The eager torch module (random weights at 1/sqrt(fan_in), see DESIGN.md)."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    def rope(x, cos, sin):
        # x: [1, heads, L, hd]; rotate pairs (even, odd)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            hd = cfg.dim // cfg.heads
            self.attn_norm, self.ffn_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
            self.w_gate = nn.Linear(cfg.dim, cfg.ffn, bias=False)
            self.w_up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
            self.w_down = nn.Linear(cfg.ffn, cfg.dim, bias=False)
            shape = (1, cfg.heads, cfg.max_seq_len, hd)
            self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

        def forward(self, x, pos, cos, sin, mask):
            b, n, _ = x.shape
            hd = cfg.dim // cfg.heads
            h = self.attn_norm(x)
            q, k, v = (w(h).view(b, n, cfg.heads, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            # Write this chunk's keys/values at its positions; attend over the whole
            # cache with a causal mask (stale cells past `pos` get weight zero).
            self.k_cache.index_copy_(2, pos, k)
            self.v_cache.index_copy_(2, pos, v)
            scores = q @ self.k_cache.transpose(-1, -2) / math.sqrt(hd)
            scores = scores.masked_fill(~mask, float("-inf"))
            att = torch.softmax(scores, dim=-1) @ self.v_cache
            x = x + self.wo(att.transpose(1, 2).reshape(b, n, cfg.dim))
            h = self.ffn_norm(x)
            return x + self.w_down(torch.nn.functional.silu(self.w_gate(h)) * self.w_up(h))

    class TinyDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab, cfg.dim)
            self.layers = nn.ModuleList(Layer() for _ in range(cfg.layers))
            self.norm = RMSNorm(cfg.dim)
            self.out = nn.Linear(cfg.dim, cfg.vocab, bias=False)
            hd = cfg.dim // cfg.heads
            inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(cfg.max_seq_len).float(), inv)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
            self.register_buffer("cells", torch.arange(cfg.max_seq_len), persistent=False)

        def forward(self, tokens, start_pos):
            pos = self.cells[: tokens.shape[1]] + start_pos  # positions of this chunk
            cos, sin = self.cos[pos], self.sin[pos]
            mask = self.cells.unsqueeze(0) <= pos.unsqueeze(1)  # [L, max_seq_len]
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, pos, cos, sin, mask)
            return self.out(self.norm(x[:, -1, :]))

    torch.manual_seed(cfg.seed)
    model = TinyDecoder()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):  # 1/sqrt(fan_in): std 0.02 makes greedy output repeat
                m.weight.normal_(0.0, 1.0 / math.sqrt(m.in_features))
    return model.eval()


def export_pte(model, out: Path, max_chunk: int) -> Path:
    """torch.export with dynamic L, XNNPACK lowering, mutable-buffer KV cache."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    length = torch.export.Dim("L", min=1, max=max_chunk)
    example = (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        exported = torch.export.export(model, example, dynamic_shapes=({1: length}, None), strict=False)
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    program = edge.to_executorch(
        ExecutorchBackendConfig(
            # ExecuTorch leaves mutated buffers uninitialised unless told: a masked cell
            # holding NaN would still poison softmax @ V, so the cache starts at zero.
            passes=[InitializedMutableBufferPass(["k_cache", "v_cache"])],
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),  # size buffers by the L bound
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(program.buffer)
    return out


def sidecar_path(pte: str | Path) -> Path:
    return Path(str(pte) + SIDECAR_SUFFIX)


def write_sidecar(pte: Path, cfg: TinyConfig) -> Path:
    meta = {
        "format": SIDECAR_FORMAT,
        "method": "forward",
        "vocab_size": cfg.vocab,
        "max_seq_len": cfg.max_seq_len,
        "max_chunk": cfg.max_chunk,
        "tokenizer": {"kind": "bytes", "offset": N_SPECIAL, "pad": 0, "bos": 1, "eos": 2},
        "chat_template": CHAT_TEMPLATE,
        "model": {"kind": "tiny-random-decoder", **asdict(cfg)},
    }
    path = sidecar_path(pte)
    path.write_text(json.dumps(meta, indent=2))
    return path


def export_tiny(out: str | Path, cfg: TinyConfig) -> Path:
    cfg.check()
    pte = export_pte(build_model(cfg), Path(out), cfg.max_chunk)
    write_sidecar(pte, cfg)
    return pte


@click.command("export-executorch")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="The .pte file to write.")
@click.option("--layers", type=int, default=TinyConfig.layers, show_default=True)
@click.option("--dim", type=int, default=TinyConfig.dim, show_default=True)
@click.option("--heads", type=int, default=TinyConfig.heads, show_default=True)
@click.option("--vocab", type=int, default=TinyConfig.vocab, show_default=True,
              help="At least 259 (byte-level tokenizer); extra ids decode to nothing.")
@click.option("--max-seq-len", type=int, default=TinyConfig.max_seq_len, show_default=True)
@click.option("--max-chunk", type=int, default=TinyConfig.max_chunk, show_default=True,
              help="Largest number of tokens one call takes.")
@click.option("--seed", type=int, default=TinyConfig.seed, show_default=True)
def export_command(out, layers, dim, heads, vocab, max_seq_len, max_chunk, seed) -> None:
    """Export a tiny random-weight decoder to an XNNPACK .pte (about a minute)."""
    cfg = TinyConfig(vocab=vocab, dim=dim, layers=layers, heads=heads, ffn=2 * dim,
                     max_seq_len=max_seq_len, max_chunk=max_chunk, seed=seed)
    try:
        cfg.check()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    import warnings

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export/ExecuTorch deprecation chatter, not the user's problem
        pte = export_tiny(out, cfg)
    click.echo(f"wrote {pte} ({pte.stat().st_size / 1e6:.1f} MB) and {sidecar_path(pte)} in {time.perf_counter() - t0:.0f} s")
