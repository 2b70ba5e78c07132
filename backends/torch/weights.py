"""Parameters for a CausalLM: a Hugging Face folder's safetensors, or random from a seed."""
from __future__ import annotations

from pathlib import Path

import torch

from dlfp.backends.torch.config import ModelConfig
from dlfp.backends.torch.model import CausalLM, init_random_


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Allocate the model on `device` in `dtype` directly (no float32 copy of an 8B model first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def safetensor_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def load_safetensors_(model: CausalLM, folder: Path) -> None:
    """Copy every tensor of the folder's shards into the model; raise naming what is missing or unknown."""
    from safetensors.torch import load_file

    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for shard in safetensor_files(folder):
            for name, tensor in load_file(str(shard)).items():
                if name not in params:
                    unknown.append(name)
                    continue
                target = params[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"{shard.name}: {name} has shape {tuple(tensor.shape)}, "
                                     f"the config gives {tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))
                seen.add(name)
    missing = set(params) - seen
    if model.cfg.tie_embeddings and "lm_head.weight" in missing and "model.embed_tokens.weight" in seen:
        missing.discard("lm_head.weight")
    if missing or unknown:
        raise ValueError(f"weights in {folder} do not match the config: missing {sorted(missing)[:5]}, "
                         f"unknown {sorted(unknown)[:5]}")


def materialise(cfg: ModelConfig, folder: Path | None, device: torch.device, dtype: torch.dtype,
                seed: int) -> tuple[CausalLM, str]:
    """The model and where its weights came from (what the trace records)."""
    model = build_model(cfg, device, dtype)
    if folder is not None and safetensor_files(folder):
        load_safetensors_(model, folder)
        return model, f"safetensors from {folder}"
    init_random_(model, seed)
    return model, f"random (seed {seed}, like vLLM's load_format=dummy): timing only, text is noise"
