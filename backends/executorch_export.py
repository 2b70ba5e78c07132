"""Build a `.pte` the ExecuTorch adapter can step: `dlfp export-executorch`.

The program has ONE method, `forward(tokens[1, L], start_pos[1]) -> logits[1, vocab]`,
with L dynamic (1..max_chunk) and the KV cache in mutable buffers, so the same
method serves a prefill chunk (L tokens at start_pos) and a decode (L = 1). The
logits are those of the chunk's last token. Linear layers are lowered to XNNPACK;
the cache update and attention mask run on ExecuTorch's portable kernels.

`--packed` exports the same decoder with the other forward layout:
`forward(tokens[1, T], slots[T], positions[T], rows[R]) -> logits[R, vocab]`, one
KV cache holding `--slots` sequences end to end (cell slot*max_seq_len + pos), the
mask built from compares so a token sees only its own slot's cells up to its
position. One call then runs a whole step (every decode and chunk), with batched
linear layers and one copy of the weights. The sidecar records the layout and how
many ops XNNPACK took (`delegation`).

The decoder is Llama-shaped (RMSNorm, RoPE on adjacent pairs, SwiGLU, GQA, tied or
separate head). `--gguf FILE` fills it with a Llama-family GGUF's dequantised
weights (gguf_weights.py: the reader the MLC build shares) and writes the GGUF's
tokenizer beside the program (`<file>.pte.tokenizer/`); without it the weights are
random and tiny (tests). A JSON sidecar (`<file>.pte.json`) carries what a `.pte`
does not: the tokenizer's kind and folder, the chat template, the shape limits.

dtype and layout (--gguf): the default is fp32 in the packed layout with 4 slots, one
copy of the weights for every sequence. `--dtype int8` lowers every linear layer to
XNNPACK's dynamic int8 scheme (int8 weights per output channel, activations quantised
per token at run time): a quarter of the weight memory, but its logits miss llama.cpp's
by ~10% of their spread (fp32: ~3%), over the 5% bound `dlfp check-model` holds; this
ExecuTorch's XNNPACK offers no int8 scheme that fits it (per-group weights are int4
only, and the error is mostly the activation rounding). `--per-sequence` loads one
Program per sequence (the layout before packing: four slots' fp32 weights cost ~4 GB).
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
    slots: int = 0  # 0: per-sequence layout; n >= 2: the packed layout with n slots

    def check(self) -> None:
        if self.vocab < BYTE_VOCAB:
            raise ValueError(f"--vocab must be at least {BYTE_VOCAB} (3 specials + 256 bytes)")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError("--dim must split into heads of even size")
        if not 2 <= self.max_chunk <= self.max_seq_len:
            raise ValueError("--max-chunk must be between 2 and --max-seq-len")
        check_slots(self.slots)


def check_slots(slots: int) -> None:
    if slots == 1 or slots < 0:
        raise ValueError("--packed needs --slots of at least 2")


@dataclass(frozen=True)
class DecoderSpec:
    """The shape of the exported decoder (Llama-style: RMSNorm, RoPE on adjacent pairs, SwiGLU, GQA)."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    max_seq_len: int
    max_chunk: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = False  # the output head reuses the embedding matrix
    slots: int = 0  # 0: per-sequence layout (one cache); n: the packed layout, one cache of n slots


def tiny_spec(cfg: TinyConfig) -> DecoderSpec:
    return DecoderSpec(vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.heads,
                       head_dim=cfg.dim // cfg.heads, ffn=cfg.ffn, max_seq_len=cfg.max_seq_len,
                       max_chunk=cfg.max_chunk, slots=cfg.slots)


def build_decoder(spec: DecoderSpec):
    """The eager torch module, weights uninitialised (torch's defaults)."""
    import torch
    from torch import nn

    hd, rep = spec.head_dim, spec.heads // spec.kv_heads

    class RMSNorm(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.norm_eps) * self.weight

    def rope(x, cos, sin):
        # x: [1, heads, L, hd]; rotate pairs (even, odd): llama.cpp's (and GGUF's) Q/K layout
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.ffn_norm = RMSNorm(spec.dim), RMSNorm(spec.dim)
            self.wq = nn.Linear(spec.dim, spec.heads * hd, bias=False)
            self.wk = nn.Linear(spec.dim, spec.kv_heads * hd, bias=False)
            self.wv = nn.Linear(spec.dim, spec.kv_heads * hd, bias=False)
            self.wo = nn.Linear(spec.heads * hd, spec.dim, bias=False)
            self.w_gate = nn.Linear(spec.dim, spec.ffn, bias=False)
            self.w_up = nn.Linear(spec.dim, spec.ffn, bias=False)
            self.w_down = nn.Linear(spec.ffn, spec.dim, bias=False)
            # KV heads only (GQA keeps the cache small); the packed layout puts its slots
            # end to end along the cell axis: slot s, position p is cell s*max_seq_len + p.
            shape = (1, spec.kv_heads, max(1, spec.slots) * spec.max_seq_len, hd)
            self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

        def forward(self, x, cells, cos, sin, bias):
            b, n, _ = x.shape
            h = self.attn_norm(x)
            # GQA without copying the cache: the rep query heads of a KV head ride as rep
            # rows per token ([b, kv, n*rep, hd], row t*rep + r), one matmul against that
            # KV head's cache; query head kv*rep + r reads KV head kv, as in llama.cpp.
            q = self.wq(h).view(b, n, spec.kv_heads, rep, hd).transpose(1, 2)  # [b, kv, n, rep, hd]
            k, v = (w(h).view(b, n, spec.kv_heads, hd).transpose(1, 2) for w in (self.wk, self.wv))
            q, k = rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), rope(k, cos, sin)
            q = q.contiguous().view(b, spec.kv_heads, n * rep, hd)
            # Write this step's keys/values at their cells; attend over the whole cache
            # with the caller's mask (stale cells, and other slots' cells, get weight zero).
            self.k_cache.index_copy_(2, cells, k)
            self.v_cache.index_copy_(2, cells, v)
            scores = q @ self.k_cache.transpose(-1, -2) / math.sqrt(hd)  # [b, kv, n*rep, S]
            scores = scores + bias  # 0 where a cell may be seen, -inf where not
            att = torch.softmax(scores, dim=-1) @ self.v_cache  # [b, kv, n*rep, hd]
            att = att.view(b, spec.kv_heads, n, rep, hd).transpose(1, 2).contiguous()
            x = x + self.wo(att.view(b, n, spec.heads * hd))
            h = self.ffn_norm(x)
            return x + self.w_down(torch.nn.functional.silu(self.w_gate(h)) * self.w_up(h))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(spec.vocab, spec.dim)
            self.layers = nn.ModuleList(Layer() for _ in range(spec.layers))
            self.norm = RMSNorm(spec.dim)
            self.out = nn.Linear(spec.dim, spec.vocab, bias=False)
            if spec.tied:
                self.out.weight = self.embed.weight
            inv = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            ang = torch.outer(torch.arange(spec.max_seq_len, dtype=torch.float64), inv)
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)
            self.register_buffer("cells", torch.arange(spec.max_seq_len), persistent=False)
            self.register_buffer("row_token", torch.arange(spec.max_chunk * rep) // rep, persistent=False)

        def forward(self, tokens, start_pos):
            pos = self.cells[: tokens.shape[1]] + start_pos  # positions of this chunk
            rows = self.row_token[: tokens.shape[1] * rep] + start_pos  # query row t*rep + r: token t
            mask = self.cells.unsqueeze(0) <= rows.unsqueeze(1)  # [L*rep, max_seq_len]
            x = self.run(tokens, pos, pos, mask)
            return self.out(self.norm(x[:, -1, :]))

        def run(self, tokens, cells, pos, mask):
            """The layers: the one decoder body both layouts share."""
            cos, sin = self.cos[pos], self.sin[pos]
            # The mask as an additive bias, made once per call: each layer then adds it
            # (an add XNNPACK takes) instead of a masked fill on portable kernels.
            bias = torch.where(mask, 0.0, float("-inf"))
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, cells, cos, sin, bias)
            return x

    class PackedDecoder(Decoder):
        """forward(tokens[1, T], slots[T], positions[T], rows[R]) -> logits[R, vocab].

        Any mix of decodes and chunks of different sequences in one call: token t
        writes cell slots[t]*S + positions[t] and sees only its own slot's cells at
        positions <= its own (the mask is compares and an AND, for portable kernels).
        `rows` picks the tokens whose logits come back (each sequence's last token).
        """

        def __init__(self):
            super().__init__()
            cell = torch.arange(spec.slots * spec.max_seq_len)
            self.register_buffer("cell_slot", cell // spec.max_seq_len, persistent=False)
            self.register_buffer("cell_pos", cell % spec.max_seq_len, persistent=False)
            # A lookup, not slots * max_seq_len: the int8 quantizer would annotate (and floatify) a mul.
            self.register_buffer("slot_base", torch.arange(spec.slots) * spec.max_seq_len, persistent=False)

        def forward(self, tokens, slots, positions, rows):
            by_row = self.row_token[: tokens.shape[1] * rep]  # query row t*rep + r: token t
            row_slot, row_pos = slots[by_row].unsqueeze(1), positions[by_row].unsqueeze(1)
            mask = (self.cell_slot.unsqueeze(0) == row_slot) & (self.cell_pos.unsqueeze(0) <= row_pos)
            x = self.run(tokens, self.slot_base[slots] + positions, positions, mask)
            return self.out(self.norm(x[0, rows, :]))

    return PackedDecoder() if spec.slots else Decoder()


def build_model(cfg: TinyConfig):
    """The tiny random-weight decoder (weights at 1/sqrt(fan_in), see DESIGN.md)."""
    import torch
    from torch import nn

    torch.manual_seed(cfg.seed)
    model = build_decoder(tiny_spec(cfg))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):  # 1/sqrt(fan_in): std 0.02 makes greedy output repeat
                m.weight.normal_(0.0, 1.0 / math.sqrt(m.in_features))
    return model.eval()


# GGUF tensor name (per layer after "blk.N.") -> this decoder's parameter name.
GGUF_LAYER_NAMES = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
                    "ffn_norm": "ffn_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}


def gguf_spec(cfg, max_seq_len: int, max_chunk: int, slots: int = 0) -> DecoderSpec:
    """The decoder shape for a GGUF's LlamaConfig (gguf_weights.read_config)."""
    return DecoderSpec(vocab=cfg.vocab_size, dim=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads,
                       kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, ffn=cfg.intermediate_size,
                       max_seq_len=max_seq_len, max_chunk=max_chunk, rope_theta=cfg.rope_theta,
                       norm_eps=cfg.rms_norm_eps, tied=cfg.tied_embeddings, slots=slots)


def state_from_gguf(weights: dict) -> dict:
    """GGUF-named float32 arrays (Q/K as llama.cpp stores them: this decoder's RoPE layout) -> a state dict."""
    import torch

    out = {"embed.weight": weights["token_embd.weight"], "norm.weight": weights["output_norm.weight"]}
    if "output.weight" in weights:
        out["out.weight"] = weights["output.weight"]
    for name, arr in weights.items():
        if name.startswith("blk."):
            _, i, kind, _ = name.split(".")
            out[f"layers.{i}.{GGUF_LAYER_NAMES[kind]}.weight"] = arr
    return {k: torch.from_numpy(v) for k, v in out.items()}


def model_from_gguf(cfg, weights: dict, max_seq_len: int, max_chunk: int, slots: int = 0):
    """The decoder with a GGUF's dequantised weights (fp32)."""
    model = build_decoder(gguf_spec(cfg, max_seq_len, max_chunk, slots))
    state = state_from_gguf(weights)
    if cfg.tied_embeddings:
        state["out.weight"] = state["embed.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"GGUF weights do not fit the decoder: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


DTYPES = ("fp32", "int8")  # int8: linear weights int8 per channel, activations quantised per token at run time


def export_inputs(max_chunk: int, slots: int = 0):
    """Example inputs and dynamic shapes: (tokens, start_pos), or the packed (tokens, slots, positions, rows)."""
    import torch

    length = torch.export.Dim("L", min=1, max=max_chunk)
    if not slots:
        return (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long)), ({1: length}, None)
    n_rows = torch.export.Dim("R", min=1, max=slots)  # one logits row per sequence in the step
    two = torch.zeros(2, dtype=torch.long)
    example = (torch.zeros(1, 2, dtype=torch.long), two, torch.arange(2), torch.arange(2))
    return example, ({1: length}, {0: length}, {0: length}, {0: n_rows})


def export_pte(model, out: Path, max_chunk: int, dtype: str = "fp32", slots: int = 0) -> tuple[Path, dict]:
    """torch.export with dynamic L, XNNPACK lowering, mutable-buffer KV cache; returns the file and
    the delegation summary (the sidecar keeps it)."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {DTYPES}")
    example, dynamic = export_inputs(max_chunk, slots)
    with torch.no_grad():
        exported = torch.export.export(model, example, dynamic_shapes=dynamic, strict=False)
        if dtype == "int8":
            exported = torch.export.export(_quantize_int8(exported, example), example,
                                           dynamic_shapes=dynamic, strict=False)
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    delegation = delegation_summary(edge)
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
    return out, delegation


def delegation_summary(edge) -> dict:
    """How many ops XNNPACK took and which stayed on portable kernels (ExecuTorch's delegation info)."""
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(edge.exported_program().graph_module)
    portable = {op: b.non_delegated for op, b in sorted(info.delegation_by_operator.items()) if b.non_delegated}
    return {"delegated_ops": int(info.num_delegated_nodes), "portable_ops": int(info.num_non_delegated_nodes),
            "delegated_subgraphs": int(info.num_delegated_subgraphs), "portable_by_op": portable}


def _quantize_int8(exported, example):
    """XNNPACK's dynamic int8 scheme for every linear layer (PT2E): a quarter of fp32's weight memory."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True))
    module = prepare_pt2e(exported.module(), quantizer)
    module(*example)  # dynamic scales need no calibration; one pass sets up the observers
    module = convert_pt2e(module)
    for name, buf in module.named_buffers():
        if name.endswith(("k_cache", "v_cache")):
            buf.zero_()  # that pass wrote two cells; the program's cache must start at zero
    return module


def sidecar_path(pte: str | Path) -> Path:
    return Path(str(pte) + SIDECAR_SUFFIX)


def tokenizer_dir(pte: str | Path) -> Path:
    """The real model's tokenizer folder, beside the program (tiny.pte -> tiny.pte.tokenizer/)."""
    return Path(str(pte) + ".tokenizer")


def write_sidecar(pte: Path, meta: dict) -> Path:
    path = sidecar_path(pte)
    path.write_text(json.dumps({"format": SIDECAR_FORMAT, "method": "forward", **meta}, indent=2))
    return path


def layout_meta(slots: int, delegation: dict) -> dict:
    """The sidecar's layout: how the adapter must call the method, and what XNNPACK took."""
    layout = {"layout": "packed", "slots": slots} if slots else {"layout": "per-sequence"}
    return {**layout, "delegation": delegation}


def export_tiny(out: str | Path, cfg: TinyConfig) -> Path:
    cfg.check()
    pte, delegation = export_pte(build_model(cfg), Path(out), cfg.max_chunk, slots=cfg.slots)
    write_sidecar(pte, {
        **layout_meta(cfg.slots, delegation),
        "vocab_size": cfg.vocab,
        "max_seq_len": cfg.max_seq_len,
        "max_chunk": cfg.max_chunk,
        "tokenizer": {"kind": "bytes", "offset": N_SPECIAL, "pad": 0, "bos": 1, "eos": 2},
        "chat_template": CHAT_TEMPLATE,
        "model": {"kind": "tiny-random-decoder", **asdict(cfg)},
    })
    return pte


def export_gguf(gguf_path: str | Path, out: str | Path, max_seq_len: int = 2048, max_chunk: int = 256,
                dtype: str = "fp32", slots: int = 0) -> Path:
    """A Llama-family GGUF's real weights, config and tokenizer as a .pte + sidecar + tokenizer folder."""
    from dlfp.backends import gguf_weights

    if not 2 <= max_chunk <= max_seq_len:
        raise ValueError("--max-chunk must be between 2 and --max-seq-len")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {DTYPES}")
    check_slots(slots)
    cfg, weights = gguf_weights.load(gguf_path)
    if max_seq_len > cfg.context_length:
        raise ValueError(f"--max-seq-len {max_seq_len} is past the model's context of {cfg.context_length}")
    out = Path(out)
    tok_dir = gguf_weights.write_tokenizer(gguf_path, tokenizer_dir(out))
    pte, delegation = export_pte(model_from_gguf(cfg, weights, max_seq_len, max_chunk, slots), out, max_chunk,
                                 dtype, slots)
    write_sidecar(pte, {
        **layout_meta(slots, delegation),
        "vocab_size": cfg.vocab_size,
        "max_seq_len": max_seq_len,
        "max_chunk": max_chunk,
        "tokenizer": {"kind": "hf", "folder": tok_dir.name},
        "model": {"kind": "gguf", "gguf": str(Path(gguf_path).resolve()), "dtype": dtype, **cfg.to_dict()},
    })
    return pte


@click.command("export-executorch")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="The .pte file to write.")
@click.option("--gguf", "gguf_file", type=click.Path(dir_okay=False), default=None,
              help="Export this Llama-family GGUF's real weights and tokenizer ('default': the bundled SmolLM2). "
                   "Without it: a tiny random-weight decoder.")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True,
              help="--gguf only: fp32 (exact) or int8 (dynamic int8 linear layers, ~1/4 the weight memory, "
                   "~10%% of the logit spread off llama.cpp).")
@click.option("--layers", type=int, default=TinyConfig.layers, show_default=True)
@click.option("--dim", type=int, default=TinyConfig.dim, show_default=True)
@click.option("--heads", type=int, default=TinyConfig.heads, show_default=True)
@click.option("--vocab", type=int, default=TinyConfig.vocab, show_default=True,
              help="At least 259 (byte-level tokenizer); extra ids decode to nothing.")
@click.option("--max-seq-len", type=int, default=None,
              help=f"Positions per sequence [tiny: {TinyConfig.max_seq_len}, --gguf: 2048].")
@click.option("--max-chunk", type=int, default=TinyConfig.max_chunk, show_default=True,
              help="Largest number of tokens one call takes.")
@click.option("--seed", type=int, default=TinyConfig.seed, show_default=True)
@click.option("--packed/--per-sequence", default=None,
              help="packed: one method call per step for every sequence (tokens carry their slot and position, "
                   "one KV cache holds --slots sequences, one copy of the weights); per-sequence: one Program "
                   "per sequence. [default: packed with --gguf, per-sequence for the tiny model]")
@click.option("--slots", type=int, default=4, show_default=True, help="--packed only: sequences the cache holds.")
def export_command(out, gguf_file, dtype, layers, dim, heads, vocab, max_seq_len, max_chunk, seed, packed,
                   slots) -> None:
    """Export a GGUF's model (--gguf), or a tiny random-weight decoder, to an XNNPACK .pte."""
    import warnings

    t0 = time.perf_counter()
    if packed is None:  # measured on SmolLM2: packed is faster from 2 sequences up and holds one copy of the weights
        packed = gguf_file is not None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.export/ExecuTorch deprecation chatter, not the user's problem
            if gguf_file is not None:
                from dlfp.backends.gguf_weights import resolve

                pte = export_gguf(resolve(gguf_file), out, max_seq_len or 2048, max_chunk, dtype,
                                  slots if packed else 0)
            else:
                cfg = TinyConfig(vocab=vocab, dim=dim, layers=layers, heads=heads, ffn=2 * dim,
                                 max_seq_len=max_seq_len or TinyConfig.max_seq_len, max_chunk=max_chunk, seed=seed,
                                 slots=slots if packed else 0)
                cfg.check()
                pte = export_tiny(out, cfg)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {pte} ({pte.stat().st_size / 1e6:.1f} MB) and {sidecar_path(pte)} in {time.perf_counter() - t0:.0f} s")
    d = json.loads(sidecar_path(pte).read_text())["delegation"]
    click.echo(f"XNNPACK took {d['delegated_ops']} ops in {d['delegated_subgraphs']} subgraphs; "
               f"{d['portable_ops']} left to portable kernels: {d['portable_by_op']}")

