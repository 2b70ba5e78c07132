"""`dlfp bench` without the terminal: build the arms, run every seed, write the files.

Each seed runs every arm on the identical schedule and prompts; the run order
alternates across seeds (as given on even seeds, reversed on odd ones) so drift
over the session (heat, other load) does not always favour the same arm.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dlfp.bench.analysis import output_agreement, trial_row
from dlfp.bench.config import BenchArgs, build_config
from dlfp.bench.paired import background_metric, goodput_summary, paired_table, sweep_summary
from dlfp.bench.runner import Arm, run_trial
from dlfp.bench.target import EngineTarget
from dlfp.policy import params_to_dict
from dlfp.runs import compress_traces
from dlfp.targets import OWNED_LOOP, TargetEntry, get_target
from dlfp.workloads.schedule import build_schedule
from dlfp.workloads.specs import Gate, WorkloadSpec, get_spec, parse_slo
from dlfp.workloads.tokens import text_pool


class BenchError(ValueError):
    """A problem with the benchmark's inputs: one line for the user."""


@dataclass
class Bench:
    args: BenchArgs
    spec: WorkloadSpec
    profile: object
    arms: list[Arm]
    out: Path
    itl_target_ms: float | None
    params: dict | None = None
    pool: list[int] | None = None  # tokenized text prompts are cut from (None: random ids)
    prompt_source: str = "random"
    rows: list[dict] = field(default_factory=list)

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]

    @property
    def total_requests(self) -> int:
        per = self.spec.warmup + sum(c.count for c in self.spec.classes) + sum(s.count * s.turns for s in self.spec.sessions)
        return per * len(self.arms) * len(self.args.seeds)


def file_label(name: str) -> str:
    """An arm name as it appears in file names (fixed:16 -> fixed-16)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def resolve_spec(args: BenchArgs) -> WorkloadSpec:
    from dataclasses import replace

    try:
        spec = get_spec(args.workload).scaled(args.scale).with_load(args.requests, args.rate)
        if args.warmup is not None:
            if args.warmup < 0:
                raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
            spec = replace(spec, warmup=args.warmup)
        if args.slo:
            spec = replace(spec, slo=parse_slo(args.slo, spec.slo))
        if args.gate_p99_itl_reduction is not None:
            spec = replace(spec, gate=Gate("itl_p99_ms", args.gate_p99_itl_reduction))
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    return spec


def policy_names(args: BenchArgs) -> list[str]:
    names = list(args.policies)
    if args.sweep:
        names = ["unbounded", *args.sweep, "dlfp"]
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


def prepare(args: BenchArgs, open_backend: Callable, profile) -> Bench:
    """Load the target(s) and check the workload fits them.

    `open_backend(name, model, profile, threads, kv_unified)` loads an owned-loop
    backend (the CLI passes one that turns load failures into one line).
    """
    spec = resolve_spec(args)
    itl_target = args.itl_target_ms if args.itl_target_ms is not None else profile.itl_target_ms
    params = None
    if args.endpoints:
        arms = [Arm(label, _endpoint(label, url, args.model), label) for label, url in _endpoint_pairs(args)]
    else:
        entry = _entry(args.backend)
        for policy in policy_names(args):
            try:
                entry.check_policy(policy)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
        if entry.kind == OWNED_LOOP:
            backend = open_backend(args.backend, args.model, profile, args.threads, args.kv_unified)
            target = EngineTarget(backend, profile, args.itl_target_ms, args.probe_period_s, args.prefix_hold_s)
        else:
            target = _external(entry, args, profile)
        arms = [Arm(p, target, p) for p in policy_names(args)]
        params = params_to_dict(profile.controller_params(args.itl_target_ms))
    bench = Bench(args, spec, profile, arms, Path(args.out), itl_target, params)
    for arm in arms:
        _check_fits(spec, arm, args.vocab_size)
    bench.pool, bench.prompt_source = _prompt_pool(args.prompts, arms[0].target, args.tokenizer)
    return bench


def _prompt_pool(kind: str, target, tokenizer: str | None = None) -> tuple[list[int] | None, str]:
    """Text prompts need a tokenizer: the target's, or for an endpoint the served model's
    GGUF (`--tokenizer`); without one an endpoint gets random ids."""
    if kind not in ("text", "random"):
        raise BenchError(f"--prompts must be text or random, got {kind!r}")
    backend = getattr(target, "backend", None)
    if kind == "random":
        return None, "random"
    if backend is None and tokenizer:
        return _gguf_pool(tokenizer), f"text (tokenizer of {tokenizer})"
    if backend is None:
        return None, "random (the target exposes no tokenizer: pass --tokenizer MODEL.gguf)"
    return text_pool(lambda text: backend.tokenize(text, add_special=False)), "text"


def _gguf_pool(path: str) -> list[int]:
    from dataclasses import replace

    from dlfp.profiles import load_profile
    from dlfp.protocol import ModelLoadError
    from dlfp.targets import load_backend

    profile = replace(load_profile("cpu-laptop"), max_sequences=1, context_per_sequence=64, max_batch_tokens=32)
    try:
        backend = load_backend("llamacpp", path, profile, n_threads=1)
    except (ValueError, OSError, ModelLoadError) as exc:
        raise BenchError(f"--tokenizer {path}: {exc}") from None
    try:
        return text_pool(lambda text: backend.tokenize(text, add_special=False))
    finally:
        backend.close()


def run(bench: Bench, on_request: Callable[[], None] | None = None,
        on_trial: Callable[[str], None] | None = None) -> dict:
    """Every seed, every arm; writes trials.jsonl as it goes, paired.json and the traces' gzip copies at the end."""
    out = bench.out
    out.mkdir(parents=True, exist_ok=True)
    write_config(bench)
    trials_path = out / "trials.jsonl"
    trials_path.write_text("")
    agreement: dict[int, dict] = {}
    vocab = _limits(bench.arms[0].target, bench.args.vocab_size)[0]
    for i, seed in enumerate(bench.args.seeds):
        schedule = build_schedule(bench.spec, seed, vocab, bench.args.burstiness, bench.pool)
        order = bench.arms if i % 2 == 0 else list(reversed(bench.arms))
        runs = []
        for k, arm in enumerate(order):
            if on_trial:
                on_trial(f"seed {seed}: {arm.name}")
            try:
                trial = run_trial(arm, schedule, k, on_request, cache_prompt=bench.args.cache_prompt)
            except RuntimeError as exc:  # e.g. an external engine that fails to start
                raise BenchError(f"{arm.name}: {exc}") from None
            paths = trial.trace.write(out, f"{seed}-{file_label(arm.name)}")
            row = trial_row(trial, schedule, bench.spec, bench.itl_target_ms) | {"trace_suffix": f"{seed}-{file_label(arm.name)}",
                                                            "trace_files": sorted(p.name for p in paths.values())}
            bench.rows.append(row)
            with open(trials_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            runs.append(trial)
        agreement[seed] = output_agreement(runs, bench.arm_names[0])
    result = summarize(bench, agreement)
    (out / "paired.json").write_text(json.dumps(result, indent=2) + "\n")
    compress_traces(out)  # the copies a kept run tracks (dlfp/runs.py)
    return result


def summarize(bench: Bench, agreement: dict) -> dict:
    names = bench.arm_names
    x_metric = "bg_prefill_tok_s_fg_active" if bench.spec.has_background else "prefill_tok_s"
    return {
        "workload": bench.spec.name,
        "arms": names,
        "seeds": bench.args.seeds,
        "itl_target_ms": bench.itl_target_ms,
        "prompt_source": bench.prompt_source,
        "paired": paired_table(bench.rows, names, bench.args.seeds, bench.spec.gate, agreement),
        "agreement": {str(s): a for s, a in agreement.items()},
        "sweep": sweep_summary(bench.rows, names, x_metric, bench.itl_target_ms),
        "goodput": goodput_summary(bench.rows, names, background_metric(bench.rows)),
    }


def write_config(bench: Bench) -> Path:
    targets = {}
    for arm in bench.arms:
        label = getattr(arm.target, "label", arm.name)
        if label not in targets:
            targets[label] = arm.target.describe()
    cfg = build_config(bench.args, bench.spec, bench.profile, targets, bench.params)
    cfg["arms"] = bench.arm_names
    cfg["prompt_source"] = bench.prompt_source
    path = bench.out / "config.json"
    bench.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    return path


def close(bench: Bench) -> None:
    seen = set()
    for arm in bench.arms:
        backend = getattr(arm.target, "backend", None)
        if backend is not None and id(backend) not in seen:
            seen.add(id(backend))
            backend.close()


# -- targets -----------------------------------------------------------------
def _endpoint_pairs(args: BenchArgs) -> list[tuple[str, str]]:
    pairs = []
    for item in args.endpoints:
        label, sep, url = item.partition("=")
        if not sep or not label or not url:
            raise BenchError(f"--endpoint needs LABEL=URL, got {item!r}")
        pairs.append((label, url))
    if len({label for label, _ in pairs}) != len(pairs):
        raise BenchError("--endpoint labels must be distinct")
    return pairs


def _endpoint(label: str, url: str, model: str | None):
    try:
        from dlfp.bench.endpoint import EndpointTarget
    except ImportError as exc:
        raise BenchError(f"--endpoint needs the endpoint client ({exc})") from None
    return EndpointTarget(base_url=url, model=model, label=label)


def _entry(name: str) -> TargetEntry:
    try:
        return get_target(name)
    except ValueError as exc:
        raise BenchError(str(exc)) from None


def _external(entry: TargetEntry, args: BenchArgs, profile):
    """An external engine's run target; what it lacks here (a GPU, MLC-LLM) is one line."""
    try:
        return entry.load(args.model, profile, itl_target_ms=args.itl_target_ms)
    except (RuntimeError, ValueError, OSError) as exc:  # not installed, a busy GPU, no NVML, a bad setting
        raise BenchError(f"backend {entry.name!r} cannot run here: {exc}") from None


def _limits(target, vocab_size: int | None = None) -> tuple[int, int | None]:
    """(vocabulary size, positions per sequence) of a target; `vocab_size` where it reports none."""
    backend = getattr(target, "backend", None)
    if backend is not None:
        caps = backend.capabilities
        return caps.vocab_size, caps.context_per_sequence
    desc = target.describe()
    vocab = desc.get("vocab_size") or vocab_size
    if not vocab:
        raise BenchError(f"target {target.label} does not report its vocabulary size, which exact-token "
                         f"prompts need: pass --vocab-size N (the served model's)")
    return int(vocab), desc.get("context_per_sequence") or (desc.get("server") or {}).get("max_model_len")


def _check_fits(spec: WorkloadSpec, arm: Arm, vocab_size: int | None) -> None:
    _, context = _limits(arm.target, vocab_size)
    need = spec.max_positions
    if context is not None and need >= context:
        fit = (context - 1) / need * spec.scale
        raise BenchError(
            f"workload {spec.name} needs {need} positions per sequence but {arm.name} has {context}; "
            f"pass --scale {fit:.3g} or less"
        )
