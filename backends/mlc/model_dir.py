"""The model folder the step-mode adapter loads (`--model DIR`).

    DIR/dlfp-mlc.json   format, function names, sizes, tokenizer and chat template
    DIR/<model_lib>     the compiled library (TVM `export_library`)
    DIR/<params>        the weights, a TVM parameter dict, in `param_names` order

MLC-LLM ships weights as `params_shard_*.bin` shards with a `tensor-cache.json`
and a tokenizer from Hugging Face; this folder keeps the same compiled function
names but a simpler layout, because its models are built by apache-tvm here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "dlfp-mlc.json"
FORMAT = "dlfp-mlc/1"
REQUIRED = ("model_lib", "params", "param_names", "target", "vocab_size", "hidden_size",
            "context_window_size", "tokenizer")


class ModelFolderError(ValueError):
    """The folder is missing, incomplete or not in this format."""


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    config: dict

    @property
    def lib_path(self) -> Path:
        return self.path / self.config["model_lib"]

    @property
    def params_path(self) -> Path:
        return self.path / self.config["params"]

    @classmethod
    def open(cls, path: str | Path) -> "ModelFolder":
        p = Path(path)
        if not p.exists():
            raise ModelFolderError(f"MLC model folder not found: {p}")
        if not p.is_dir():
            raise ModelFolderError(f"the mlc backend takes a model folder (with {CONFIG_NAME}), not a file: {p}")
        cfg_path = p / CONFIG_NAME
        if not cfg_path.is_file():
            raise ModelFolderError(f"no {CONFIG_NAME} in {p}; build one with `python -m dlfp.backends.mlc.build_tiny DIR`")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelFolderError(f"{cfg_path} is not valid JSON: {exc}") from None
        if cfg.get("format") != FORMAT:
            raise ModelFolderError(f"{cfg_path}: format {cfg.get('format')!r}, expected {FORMAT!r}")
        missing = [k for k in REQUIRED if k not in cfg]
        if missing:
            raise ModelFolderError(f"{cfg_path}: missing keys {missing}")
        folder = cls(p, cfg)
        for f in (folder.lib_path, folder.params_path):
            if not f.is_file():
                raise ModelFolderError(f"{cfg_path} names {f.name}, which is not in {p}")
        return folder

    def write(self) -> None:
        (self.path / CONFIG_NAME).write_text(json.dumps(self.config, indent=2) + "\n")
