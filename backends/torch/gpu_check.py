"""The torch backend's GPU check: paper models' architectures, the Agent workload, three arms, two modes.

Run by `scripts/gpu_torch_check.sh`. Needs only torch and numpy (the device machine has
no click/rich/scipy guarantee), so it drives the bench's own pieces directly: the
workload schedule, `run_trial` over dlfp's engine, `trial_row` and `output_agreement`.
One seed, so changes are per trial (no interval).

Per model (random weights from the bundled config unless a folder is given):
1. load once; calibrate: median step time of a decode-only step with every slot
   decoding, and of a full-budget prefill step beside one decode;
2. the target (`--target-ms auto`): a decode-only step meets it, a full-budget step
   misses it: decode + 30% of the difference;
3. per mode (sync; async = step k+1 launched before step k's tokens reach the host),
   the arms unbounded, dlfp-cadence, dlfp on the same schedule.
Files under --out: trials.jsonl, agreement.json, calibration.json, per-trial traces.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from dlfp.protocol import DecodeItem, PrefillChunk, StepPlan
from dlfp.bench.analysis import output_agreement, trial_row
from dlfp.bench.runner import Arm, run_trial
from dlfp.bench.target import EngineTarget
from dlfp.devices.profiles import load_profile
from dlfp.workloads.schedule import build_schedule
from dlfp.workloads.specs import get_spec

TARGET_SHARE = 0.3  # where the auto target sits between a decode-only and a full-budget step


def calibrate(backend, repeats: int = 5) -> dict:
    """Median decode-only and full-budget step times (s), on scratch slots freed afterwards."""
    caps = backend.capabilities
    n = caps.max_sequences
    vocab = caps.vocab_size
    for s in range(n):
        backend.free_sequence(s)
    backend.step(StepPlan(prefills=[PrefillChunk(s, [7 + s % 50] * 8, 0, True) for s in range(n)]))
    decode, full = [], []
    budget = caps.max_batch_tokens - 1
    prompt = [(13 * i) % vocab for i in range(budget)]
    for r in range(repeats + 1):  # the first of each is warm-up (kernel selection, allocator)
        pos = 8 + r
        decode.append(backend.step(StepPlan(decodes=[DecodeItem(s, 11, pos) for s in range(n)])).duration_s)
        backend.free_sequence(n - 1)  # scratch: refilled from position 0, longer than any decode position
        full.append(backend.step(StepPlan(decodes=[DecodeItem(0, 11, pos)],
                                          prefills=[PrefillChunk(n - 1, prompt, 0, True)])).duration_s)
    for s in range(n):
        backend.free_sequence(s)
    d, f = statistics.median(decode[1:]), statistics.median(full[1:])
    return {"decode_step_ms": d * 1e3, "full_step_ms": f * 1e3, "full_step_tokens": caps.max_batch_tokens,
            "auto_target_ms": (d + TARGET_SHARE * max(0.0, f - d)) * 1e3}


def set_mode(backend, mode: str) -> None:
    """sync: each step waits for its results; async: the engine launches step k+1 first."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    backend.pipelined = mode == "async"


def run_model(model: str, args, profile, out: Path, done: list[dict]) -> tuple[list[dict], dict]:
    from dlfp.backends.torch.backend import from_profile

    t0 = time.perf_counter()
    backend = from_profile(model, profile, args.threads, device=args.device, dtype=args.dtype, seed=args.seed)
    load_s = time.perf_counter() - t0
    cal = calibrate(backend)
    target_ms = cal["auto_target_ms"] if args.target_ms == "auto" else float(args.target_ms)
    info = {"model": model, "load_s": load_s, "target_ms": target_ms, **cal, "backend": backend.describe()}
    print(f"[{model}] loaded in {load_s:.1f} s; decode step {cal['decode_step_ms']:.2f} ms, "
          f"{cal['full_step_tokens']}-token step {cal['full_step_ms']:.2f} ms -> target {target_ms:.2f} ms", flush=True)
    spec = replace(get_spec("agent").scaled(args.scale).with_load(args.requests, args.rate), warmup=args.warmup)
    schedule = build_schedule(spec, args.seed, backend.capabilities.vocab_size)
    target = EngineTarget(backend, profile, target_ms)
    rows, agreement = [], {}
    tag = model.replace("/", "_")
    for mode in args.modes:
        set_mode(backend, mode)
        runs = []
        for k, arm in enumerate(args.arms):
            t = time.perf_counter()
            trial = run_trial(Arm(arm, target, arm), schedule, k)
            suffix = f"{tag}-{mode}-{args.seed}-{arm.replace(':', '_')}"
            trial.trace.write(out, suffix)
            row = trial_row(trial, schedule, spec) | _step_figures(trial.trace, target_ms) | {
                "model": model, "mode": mode, "target_ms": target_ms, "wall_s": time.perf_counter() - t,
                "trace_suffix": suffix}
            rows.append(row)
            runs.append(trial)
            # Written after every arm: a run cut short by the time limit keeps what it measured.
            (out / "trials.jsonl").write_text("".join(json.dumps(x) + "\n" for x in done + rows))
            print(f"[{model}] {mode} {arm}: {row['wall_s']:.0f} s, ITL P99 {row.get('itl_p99_ms') or 0:.1f} ms", flush=True)
        agreement[mode] = output_agreement(runs, args.arms[0])
    backend.close()
    del backend, target
    _free_device()
    info["agreement"] = agreement
    return rows, info


def _step_figures(trace, target_ms: float) -> dict:
    """Steps that guarded a decode: how often the completed step missed the target, and
    how the observed signal compares with the device's own time for the same step."""
    guarded = [s for s in trace.steps if s.guarded and s.n_prefill_fg + s.n_prefill_bg > 0]
    over = [s for s in guarded if s.duration_s * 1e3 > target_ms]
    dev = [s.device_duration_s for s in trace.steps if s.device_duration_s is not None]
    ratios = [s.observed_s / s.duration_s for s in guarded if s.observed_s and s.duration_s]
    return {
        "guarded_steps": len(guarded),
        "guarded_over_target": len(over) / len(guarded) if guarded else None,
        "mean_cap": statistics.fmean(s.cap for s in guarded if s.cap is not None) if any(s.cap for s in guarded) else None,
        "device_step_p50_ms": statistics.median(dev) * 1e3 if dev else None,
        "observed_over_completed_p50": statistics.median(ratios) if ratios else None,
    }


def _free_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    """Markdown: per model and mode, each arm against unbounded on the same schedule."""
    head = ("| model | mode | arm | ITL P50 (ms) | ITL P99 (ms) | P99 vs unbounded | TTFT P99 (ms) | device step P50 "
            "(ms) | guarded steps over target | mean cap | observed/completed | tokens out/expected | reconciled |")
    lines = [head, "|" + "---|" * 3 + "---:|" * 9 + "---|"]
    base = {(r["model"], r["mode"]): r for r in rows if r["policy"] == "unbounded"}
    for r in rows:
        b = base.get((r["model"], r["mode"]))
        change = "-"
        if b is not None and r is not b and b.get("itl_p99_ms") and r.get("itl_p99_ms") is not None:
            change = f"{(r['itl_p99_ms'] / b['itl_p99_ms'] - 1) * 100:+.1f}%"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['policy']} | {_f(r.get('itl_p50_ms'))} | {_f(r.get('itl_p99_ms'))} | "
            f"{change} | {_f(r.get('ttft_p99_ms'))} | {_f(r.get('device_step_p50_ms'), 2)} | "
            f"{_pct(r['guarded_over_target'])} | {_f(r['mean_cap'], 0)} | "
            f"{_f(r['observed_over_completed_p50'], 2)} | {r['output_tokens']}/{r['expected_output_tokens']} "
            f"({r['completed']}/{r['submitted']} req) | {r['reconciled']} |")
    return "\n".join(lines)


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--arms", default="unbounded,dlfp-cadence,dlfp")
    p.add_argument("--profile")
    p.add_argument("--table-from", default=None, help="only print the table of an earlier (or cut-short) run's folder")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs)")
    p.add_argument("--seed", type=int, default=801)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--target-ms", default="auto")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.table_from:
        rows = [json.loads(x) for x in (Path(args.table_from) / "trials.jsonl").read_text().splitlines() if x.strip()]
        print(table(rows))
        return 0
    if not args.profile or not args.out:
        p.error("--profile and --out are required")
    args.modes = [m for m in args.modes.split(",") if m]
    args.arms = [a for a in args.arms.split(",") if a]
    if args.arms[0] != "unbounded":
        p.error("the first arm is the baseline and must be unbounded")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.profile)
    rows, infos = [], []
    for model in [m for m in args.models.split(",") if m]:
        r, info = run_model(model, args, profile, out, rows)
        rows += r
        infos.append(info)
        (out / "trials.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        (out / "models.json").write_text(json.dumps(infos, indent=2, default=str) + "\n")
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    for info in infos:
        for mode, arms in info["agreement"].items():
            for arm, a in arms.items():
                print(f"greedy agreement {info['model']} {mode} {arm} vs unbounded: {a['compared'] - len(a['mismatches'])}"
                      f"/{a['compared']} requests identical")
    bad = [r for r in rows if not r["reconciled"]]
    if bad:
        print(f"token accounting failed in {len(bad)} trial(s): {[(r['model'], r['mode'], r['policy']) for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
