"""Build a tiny random-weight model folder for the mlc step-mode adapter.

    python -m dlfp.backends.mlc.build_tiny OUT [--seed 0] [--layers 2] [--hidden 64]

Compiles `tiny_model.TinyLlama` with apache-tvm for the CPU (LLVM), draws its
weights from N(0, 1/fan_in) (std 0.02 makes greedy decoding repeat one token),
and writes the folder described in `model_dir`. Takes seconds on two cores.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from dlfp.backends.mlc.model_dir import FORMAT, ModelFolder
from dlfp.backends.mlc.tokenizer import ByteTokenizer

LIB_NAME = "model.so"
PARAMS_NAME = "params.bin"


def random_weights(named_shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in named_shapes:
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype=np.float32)
        elif name.startswith("embed_tokens"):
            out[name] = rng.standard_normal(shape, dtype=np.float32)  # rows feed an RMSNorm: unit scale
        else:
            out[name] = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
    return out


SCHEDULES = ("none", "dlight")


def add_schedule_option(ap) -> None:
    ap.add_argument("--schedule", choices=SCHEDULES, default="dlight",
                    help="dlight (default): fused weight-transpose matmuls and TVM's CPU schedule rules; "
                         "none: apache-tvm's default CPU pipeline (plain loops, ~10x slower decode)")


def relax_pipeline(target, schedule: str):
    """apache-tvm's CPU pipeline, plus (schedule "dlight") TVM's generic CPU rules after legalisation.

    The default CPU pipeline schedules nothing: every kernel is a plain single-threaded loop nest,
    and each linear layer transposes its weight (a copy of it every call) before a matmul that
    reads the copy with a stride. FuseTransposeMatmul (as MLC-LLM's own pipeline does) makes it one
    kernel reading the weight rows in place; dlight's CPU rules then tile, vectorise and parallelise
    the GEMV (decode: one row times a weight) and reduction (norms) kernels.
    """
    if schedule == "none":
        return "default"
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: choose one of {SCHEDULES}")
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.s_tir import dlight

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        with target:
            passes = (cpu.library_dispatch_passes(target) + [relax.transform.FuseTransposeMatmul()]
                      + cpu.legalize_passes(target)
                      + [dlight.ApplyDefaultSchedule(dlight.cpu.GEMV(), dlight.cpu.Reduction())]
                      + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def compile_model(cfg, out: Path, schedule: str = "dlight") -> list[tuple[str, tuple[int, ...]]]:
    """Compile the Llama model of `cfg` for the CPU into out/LIB_NAME; returns its (param, shape) list in order."""
    import tvm
    from tvm.target import Target

    from dlfp.backends.mlc.tiny_model import TinyLlama

    target = Target("llvm")
    model = TinyLlama(cfg, target)
    mod, params = model.export_tvm(spec=model.spec())
    with target:
        executable = tvm.compile(mod, target, relax_pipeline=relax_pipeline(target, schedule))
    out.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(out / LIB_NAME))
    return [(name, tuple(int(d) for d in p.shape)) for name, p in params]


def write_folder(out: Path, cfg, shapes, weights: dict[str, np.ndarray], tokenizer: dict, model: dict,
                 note: str, schedule: str = "none") -> ModelFolder:
    """Save the weights in `shapes` order and the folder's config; returns the opened folder."""
    import tvm

    for name, shape in shapes:
        if weights[name].shape != shape:
            raise ValueError(f"weight {name}: shape {weights[name].shape}, the compiled model takes {shape}")
    tvm.runtime.save_param_dict_to_file({k: tvm.runtime.tensor(weights[k]) for k, _ in shapes}, str(out / PARAMS_NAME))
    folder = ModelFolder(out, {
        "format": FORMAT,
        "model_lib": LIB_NAME,
        "params": PARAMS_NAME,
        "param_names": [name for name, _ in shapes],
        "target": "llvm",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "context_window_size": cfg.context_window_size,
        "tokenizer": tokenizer,
        "model": model,
        "weights": note,
        "built_with": {"apache_tvm": tvm.__version__, "schedule": schedule},
    })
    folder.write()
    return ModelFolder.open(out)


def build_tiny(out: str | Path, seed: int = 0, schedule: str = "dlight", **overrides) -> ModelFolder:
    """Compile the tiny model and write its folder to `out`; returns the opened folder."""
    from dlfp.backends.mlc.tiny_model import TinyConfig

    tok = ByteTokenizer.chatml_config()
    cfg = replace(TinyConfig(), **overrides)
    if cfg.vocab_size < ByteTokenizer.from_config(tok).size:
        raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the byte tokenizer's vocabulary")
    out = Path(out)
    shapes = compile_model(cfg, out, schedule)
    return write_folder(out, cfg, shapes, random_weights(shapes, seed), tok,
                        {"architecture": "tiny-llama", **cfg.to_dict()},
                        f"random N(0, 1/fan_in), seed {seed}: a test model, its text is noise", schedule)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dlfp.backends.mlc.build_tiny", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 2)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 64)")
    add_schedule_option(ap)
    args = ap.parse_args(argv)
    overrides = {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    if args.hidden is not None:
        overrides["hidden_size"] = args.hidden
    try:
        folder = build_tiny(args.out, args.seed, args.schedule, **overrides)
    except (ValueError, OSError) as exc:
        print(f"build_tiny: {exc}", file=sys.stderr)
        return 2
    print(folder.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
