"""A Llama/Qwen3-family architecture, read from a Hugging Face config.json.

Only what the model file needs: sizes, RoPE base, norm epsilon, whether q/k are
normalised per head (Qwen3) and whether the output head shares the embedding.
Bundled configs (`configs/*.json`) are architecture facts of the paper's models,
used with random weights where no checkpoint can be fetched.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SUPPORTED = {"LlamaForCausalLM": False, "Qwen3ForCausalLM": True, "Qwen2ForCausalLM": False}  # -> q/k norm


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    eos_ids: tuple[int, ...]
    bos_id: int | None
    dtype: str  # the checkpoint's own dtype (torch_dtype)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        arch = (d.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED:
            raise ValueError(f"architecture {arch!r} is not supported by the torch backend; "
                             f"supported: {', '.join(SUPPORTED)}")
        if d.get("rope_scaling"):
            raise ValueError(f"rope_scaling {d['rope_scaling']} is not supported by the torch backend")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rms_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_positions=int(d.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                qk_norm=SUPPORTED[arch],
                # Qwen2 has q/k/v biases without saying so in its config.
                attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
                eos_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                bos_id=d.get("bos_token_id"),
                dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            )
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """From a config.json, a folder holding one, or a bundled name (`qwen3-0.6b`, `qwen3-8b`, `tiny`)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            bundled = bundled_config(str(path))
            if bundled is None:
                raise FileNotFoundError(f"no config.json at {path} and no bundled config of that name "
                                        f"(bundled: {', '.join(bundled_names())})")
            return cls.from_dict(bundled)
        return cls.from_dict(json.loads(p.read_text()))

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not split into {self.num_kv_heads} KV groups")

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def bundled_names() -> list[str]:
    folder = resources.files("dlfp.backends.torch") / "configs"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def bundled_config(name: str) -> dict | None:
    res = resources.files("dlfp.backends.torch") / "configs" / f"{name.lower()}.json"
    return json.loads(res.read_text()) if res.is_file() else None
