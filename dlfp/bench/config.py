"""config.json: everything needed to know what ran, and to run it again.

`args` holds the command's options exactly; `dlfp bench --from DIR/config.json`
rebuilds the run from them. The rest (model hash, versions, machine) is there to
tell whether a rerun happened under the same conditions.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dlfp.prefix_cache import DEFAULT_HOLD_S
from dlfp.provenance import provenance


@dataclass
class BenchArgs:
    workload: str = "laptop"
    policies: list[str] = field(default_factory=lambda: ["unbounded", "dlfp"])
    seeds: list[int] = field(default_factory=lambda: [801, 802, 803])
    rate: float | None = None
    requests: int | None = None
    warmup: int | None = None
    scale: float = 1.0
    burstiness: float = 1.0
    slo: str | None = None
    out: str = "runs/bench"
    backend: str = "llamacpp"
    model: str | None = None
    profile: str = "cpu-laptop"
    threads: int | None = None
    kv_unified: bool = False
    itl_target_ms: float | None = None
    sweep: list[str] | None = None
    overhead: bool = False
    gate_p99_itl_reduction: float | None = None
    endpoints: list[str] = field(default_factory=list)
    vocab_size: int | None = None  # for endpoints that do not report theirs
    prompts: str = "text"  # text windows of the bundled corpus, or random ids
    cache_prompt: bool = True  # False: every request asks for a cold prefill (no prefix reuse)
    tokenizer: str | None = None  # endpoints: a GGUF whose tokenizer cuts the text prompts
    probe_period_s: float | None = 0.5
    prefix_hold_s: float = DEFAULT_HOLD_S  # a conversation's cached prefix is kept from background this long (in-process)

    @classmethod
    def from_dict(cls, data: dict) -> "BenchArgs":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"config args: unknown keys {sorted(unknown)}")
        return cls(**data)


def load_args(path: str | Path) -> BenchArgs:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--from: cannot read {p}: {exc}") from None
    if "args" not in data:
        raise ValueError(f"--from: {p} has no 'args' (not a dlfp bench config.json)")
    return BenchArgs.from_dict(data["args"])


def build_config(args: BenchArgs, spec, profile, targets: dict[str, dict], params: dict | None) -> dict:
    models = [desc.get("model_path") for desc in targets.values()]
    cfg = provenance(models=models, threads=args.threads)
    cfg.update({
        "args": asdict(args),
        "workload": spec.to_dict(),
        "profile": asdict(profile),
        "controller": params,
        "targets": targets,
    })
    return cfg
