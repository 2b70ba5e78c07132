"""The model folder the step-mode adapter loads (`--model DIR`).

    DIR/dlfp-mlc.json   format, function names, sizes, tokenizer and chat template
    DIR/<model_lib>     the compiled library (TVM `export_library`)
    DIR/<params>        the weights, a TVM parameter dict, in `param_names` order

MLC-LLM's own layout (what `mlc_llm convert_weight` + `mlc_llm compile` write) is
read too: `mlc-chat-config.json` (sizes, token ids, compile-time limits), weights
as `params_shard_*.bin` shards indexed by `tensor-cache.json` (loaded with TVM's
`vm.builtin.tensor_cache.load`), the Hugging Face tokenizer files, and the
compiled library, which must be the one `*.so` in the folder. This reader is
written against that format and tested on folders `build --layout mlc` writes in
it; it has not been run on real `mlc_llm` output (MLC-LLM is not on PyPI).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "dlfp-mlc.json"
FORMAT = "dlfp-mlc/1"
MLC_CONFIG_NAME = "mlc-chat-config.json"
MLC_FORMAT = "mlc-llm"
TENSOR_CACHE = "tensor-cache.json"
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
        if not cfg_path.is_file() and (p / MLC_CONFIG_NAME).is_file():
            return cls._open_mlc(p)
        if not cfg_path.is_file():
            raise ModelFolderError(f"no {CONFIG_NAME} or {MLC_CONFIG_NAME} in {p}; build one with "
                                   "`python -m dlfp.backends.mlc.build DIR --gguf FILE`")
        cfg = _read_json(cfg_path)
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

    @property
    def is_tensor_cache(self) -> bool:
        return self.config["params"] == TENSOR_CACHE

    @classmethod
    def _open_mlc(cls, p: Path) -> "ModelFolder":
        """MLC-LLM's layout, mapped onto this folder's config keys."""
        mlc = _read_json(p / MLC_CONFIG_NAME)
        libs = sorted(f.name for f in p.glob("*.so"))
        if len(libs) != 1:
            raise ModelFolderError(f"{p} holds {len(libs)} compiled libraries (*.so); put exactly one there "
                                   f"(`mlc_llm compile {p / MLC_CONFIG_NAME} --device cpu -o {p}/model.so`)")
        if not (p / TENSOR_CACHE).is_file():
            raise ModelFolderError(f"no {TENSOR_CACHE} in {p} (the weights of `mlc_llm convert_weight`)")
        model_cfg = mlc.get("model_config") or {}
        missing = [k for k, v in (("vocab_size", mlc.get("vocab_size")), ("model_config.hidden_size",
                   model_cfg.get("hidden_size")), ("context_window_size", mlc.get("context_window_size"))) if v is None]
        if missing:
            raise ModelFolderError(f"{p / MLC_CONFIG_NAME}: missing {missing}")
        eos = mlc.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        stops = (mlc.get("conv_template") or {}).get("stop_token_ids") or []
        folder = cls(p, {
            "format": MLC_FORMAT,
            "model_lib": libs[0],
            "params": TENSOR_CACHE,
            "param_names": None,  # from the library's metadata, else the tensor cache's order
            "target": "llvm",  # assumed: TVM refuses a library built for another device when it loads
            "vocab_size": int(mlc["vocab_size"]),
            "hidden_size": int(model_cfg["hidden_size"]),
            "context_window_size": int(mlc["context_window_size"]),
            "prefill_chunk_size": mlc.get("prefill_chunk_size"),
            "max_batch_size": mlc.get("max_batch_size"),
            "tokenizer": {"kind": "hf", "folder": ".", "eog_ids": sorted({int(i) for i in [*eos, *stops]}),
                          "bos_id": mlc.get("bos_token_id"), "add_bos": False},
            "model": {"architecture": mlc.get("model_type"), "quantization": mlc.get("quantization")},
            "weights": f"MLC tensor cache ({mlc.get('quantization', 'unknown quantization')})",
        })
        if not folder.lib_path.is_file():
            raise ModelFolderError(f"{folder.lib_path} is not a file")
        return folder

    def write(self) -> None:
        (self.path / CONFIG_NAME).write_text(json.dumps(self.config, indent=2) + "\n")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{path} is not valid JSON: {exc}") from None
