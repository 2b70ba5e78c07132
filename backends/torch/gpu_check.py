"""The torch backend's GPU check: the paper's models' architectures, the Agent workload, four arms, two modes.

Run by `scripts/gpu_torch_check.sh` (which runs it from the checkout through
`scripts/run_from_checkout.py`). Needs only torch and numpy: it drives the bench's own
pieces directly (the workload schedule, `run_trial` over dlfp's engine, `trial_row`,
`output_agreement`), never click, rich, scipy or psutil. One seed, so changes are per
trial (no interval).

Per model (random weights from the bundled config unless a folder is given):
1. load once; check that launching ahead (placeholder decodes) gives the step-by-step
   greedy tokens on this device (exact: the same plans run the same kernels);
2. calibrate at the positions the workload reaches: the median step of every slot
   decoding at the middle of the output, and of one such decode beside a full-budget
   prompt chunk over the middle of the prompt;
3. the target (`--target-ms auto`): decode-only + 30% of the way to the full-budget step;
4. per mode (async: step k+1 launched before step k's tokens reach the host; sync),
   the arms on the same schedule: unbounded, dlfp-cadence (the paper's law fed the
   scheduler-call interval), dlfp-paper (the same law fed completed step time), dlfp.
Before each arm it prints its time estimate (from the calibration for a model's first
arm, then the longest arm measured), and it leaves an arm out (and says so) when that
estimate says it cannot finish inside `--limit-s`; a model is not loaded past the limit.

Fails (exit 1, each reason printed) when an arm completes fewer requests than it
submitted, when launching ahead changes greedy tokens, when an arm is left out, or,
where agreement is required (fp32), when an arm's greedy tokens differ from unbounded.
Files: see gpu_report.py.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from dlfp.backends.torch.gpu_report import Results, step_figures
from dlfp.bench.analysis import output_agreement, trial_row
from dlfp.bench.runner import Arm, run_trial
from dlfp.bench.target import EngineTarget
from dlfp.profiles import load_profile
from dlfp.protocol import PLACEHOLDER_TOKEN, DecodeItem, PrefillChunk, StepPlan
from dlfp.provenance import write_config
from dlfp.workloads.schedule import Schedule, build_schedule
from dlfp.workloads.specs import get_spec

TARGET_SHARE = 0.3  # where the auto target sits between a decode-only and a full-budget step
ARMS = "unbounded,dlfp-cadence,dlfp-paper,dlfp"


def workload_positions(schedule: Schedule, context: int, budget: int) -> tuple[int, int]:
    """(decode position, chunk start) the workload reaches: its decodes at the middle of
    the output, a full-budget chunk over the middle of the prompt (the mean start of a
    prompt's chunks), both inside the context."""
    prompt = int(statistics.median(len(p.prompt_ids) for p in schedule.measured))
    output = int(statistics.median(p.max_tokens for p in schedule.measured))
    decode = min(prompt + output // 2, context - 2)
    chunk = max(0, min((prompt - budget) // 2, context - budget, decode))
    return decode, chunk


def calibrate(backend, decode_pos: int, chunk_start: int, repeats: int = 5) -> dict:
    """Median step times (ms) at the given positions: every slot decoding, and one decode beside
    a full-budget chunk. Every slot is prefilled to `decode_pos` first and freed afterwards."""
    caps = backend.capabilities
    n, budget, vocab = caps.max_sequences, caps.max_batch_tokens, caps.vocab_size
    if n < 2:
        raise ValueError("calibration needs two slots (a decode beside a chunk)")
    t0 = time.perf_counter()
    for s in range(n):
        backend.free_sequence(s)
        for start in range(0, decode_pos, budget):
            ids = [(13 * i + s) % vocab for i in range(start, min(decode_pos, start + budget))]
            backend.step(StepPlan(prefills=[PrefillChunk(s, ids, start, False)]))
    fill_s = time.perf_counter() - t0
    chunk = [(7 * i) % vocab for i in range(budget - 1)]
    decode, full = [], []
    for _ in range(repeats + 1):  # the first of each is warm-up (kernel selection, allocator)
        plan = StepPlan(decodes=[DecodeItem(s, 11, decode_pos) for s in range(n)])
        decode.append(backend.step(plan).duration_s)
    for _ in range(repeats + 1):  # after the decodes: the chunk shortens slot n-1's filled length
        plan = StepPlan(decodes=[DecodeItem(0, 11, decode_pos)], prefills=[PrefillChunk(n - 1, chunk, chunk_start, True)])
        full.append(backend.step(plan).duration_s)
    for s in range(n):
        backend.free_sequence(s)
    d, f = statistics.median(decode[1:]), statistics.median(full[1:])
    return {"decode_position": decode_pos, "chunk_start": chunk_start, "decoding_slots": n, "fill_s": fill_s,
            "decode_step_ms": d * 1e3, "full_step_ms": f * 1e3, "full_step_tokens": budget,
            "auto_target_ms": (d + TARGET_SHARE * max(0.0, f - d)) * 1e3}


def pipeline_check(backend, steps: int = 8) -> dict:
    """Greedy tokens of two prompts decoded step by step, then again with each step launched
    before the previous one is collected (placeholder decodes): the same plans, so identical."""
    vocab = backend.capabilities.vocab_size
    prompts = {0: [(5 * i + 3) % vocab for i in range(33)], 1: [(11 * i + 7) % vocab for i in range(57)]}

    def prefill():
        for s in prompts:
            backend.free_sequence(s)
        return StepPlan(prefills=[PrefillChunk(s, p, 0, True) for s, p in prompts.items()])

    def decode(k, token):
        return StepPlan(decodes=[DecodeItem(s, token(s), len(p) + k) for s, p in prompts.items()])

    res = backend.step(prefill())
    sync = {s: [res.token_ids[s]] for s in prompts}
    for k in range(steps):
        res = backend.step(decode(k, lambda s: sync[s][-1]))
        for s in prompts:
            sync[s].append(res.token_ids[s])
    ahead = {s: [] for s in prompts}
    pending = backend.launch(prefill())
    for k in range(steps):
        following = backend.launch(decode(k, lambda s: PLACEHOLDER_TOKEN))
        for s, t in pending.wait().token_ids.items():
            ahead[s].append(t)
        pending = following
    for s, t in pending.wait().token_ids.items():
        ahead[s].append(t)
    for s in prompts:
        backend.free_sequence(s)
    return {"identical": ahead == sync, "tokens": sum(len(t) for t in sync.values())}


def estimate_arm_s(schedule: Schedule, cal: dict) -> float:
    """A first arm's time from the calibration: the warmup, then the arrivals or the prompt
    work (whichever is longer), then the last request's output."""
    per_token_s = cal["full_step_ms"] / 1e3 / cal["full_step_tokens"]
    decode_s = cal["decode_step_ms"] / 1e3
    warm = sum(len(p.prompt_ids) * per_token_s + p.max_tokens * decode_s for p in schedule.warmup)
    prompts = sum(len(p.prompt_ids) for p in schedule.measured) * per_token_s
    last = schedule.measured[-1]
    return warm + max(last.arrival_s, prompts) + last.max_tokens * decode_s


def set_mode(backend, mode: str) -> None:
    """sync: each step waits for its results; async: the engine launches step k+1 first."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    backend.pipelined = mode == "async"


class Deadline:
    """The run's time limit, and what the arms measured so far say the next one needs."""

    def __init__(self, limit_s: float):
        self.t0 = time.perf_counter()
        self.limit_s = limit_s
        self.walls: dict[tuple[str, str], list[float]] = {}  # (model, mode) -> arm wall times

    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.t0)

    def measured(self, model: str, mode: str) -> float | None:
        """The longest arm of this model (this mode's where measured): the next one's estimate."""
        same = self.walls.get((model, mode)) or [w for (m, _), ws in self.walls.items() if m == model for w in ws]
        return max(same) if same else None


def run_model(model: str, args, profile, results: Results, deadline: Deadline) -> None:
    from dlfp.backends.torch.backend import from_profile

    if deadline.left() <= 0:  # not even loaded: nothing of it could be measured
        results.not_run += [f"{model} {mode} {arm}: the time limit ({deadline.limit_s:.0f} s) was reached"
                            for mode in args.modes for arm in args.arms]
        say(f"[{model}] left out: the time limit ({deadline.limit_s:.0f} s) was reached")
        results.flush()
        return
    t0 = time.perf_counter()
    backend = from_profile(model, profile, args.threads, device=args.device, dtype=args.dtype, seed=args.seed)
    load_s = time.perf_counter() - t0
    spec = replace(get_spec("agent").scaled(args.scale).with_load(args.requests, args.rate), warmup=args.warmup)
    schedule = build_schedule(spec, args.seed, backend.capabilities.vocab_size)
    caps = backend.capabilities
    check = pipeline_check(backend)
    cal = calibrate(backend, *workload_positions(schedule, caps.context_per_sequence, caps.max_batch_tokens))
    target_ms = cal["auto_target_ms"] if args.target_ms == "auto" else float(args.target_ms)
    first_guess = estimate_arm_s(schedule, cal)
    info = {"model": model, "load_s": load_s, "target_ms": target_ms, **cal, "pipeline_check": check,
            "first_arm_estimate_s": first_guess, "backend": backend.describe(), "agreement": {}}
    results.set_model(info)
    say(f"[{model}] loaded in {load_s:.1f} s; launch-ahead tokens {'identical' if check['identical'] else 'DIFFER'}; "
        f"at position {cal['decode_position']}: decode step ({cal['decoding_slots']} slots) {cal['decode_step_ms']:.2f} ms, "
        f"{cal['full_step_tokens']}-token step from {cal['chunk_start']} {cal['full_step_ms']:.2f} ms -> target "
        f"{target_ms:.2f} ms (calibration fill {cal['fill_s']:.1f} s)")
    target = EngineTarget(backend, profile, target_ms)
    tag = model.replace("/", "_")
    for mode in args.modes:
        set_mode(backend, mode)
        runs = []
        for k, arm in enumerate(args.arms):
            measured = deadline.measured(model, mode)
            guess = measured if measured is not None else first_guess
            label = f"[{model}] {mode} {arm} ({k + 1}/{len(args.arms)})"
            if guess > deadline.left():
                results.not_run.append(f"{model} {mode} {arm}: needs about {guess:.0f} s, "
                                       f"{max(0.0, deadline.left()):.0f} s left of {deadline.limit_s:.0f}")
                say(f"{label}: left out ({results.not_run[-1]})")
                results.flush()
                continue
            say(f"{label}: estimated {guess:.0f} s ({'as measured' if measured is not None else 'from calibration'}); "
                f"{deadline.left():.0f} s left of {deadline.limit_s:.0f}")
            t = time.perf_counter()
            trial = run_trial(Arm(arm, target, arm), schedule, k)
            wall = time.perf_counter() - t
            deadline.walls.setdefault((model, mode), []).append(wall)
            suffix = f"{tag}-{mode}-{args.seed}-{arm.replace(':', '_')}"
            row = trial_row(trial, schedule, spec) | step_figures(trial.trace, target_ms) | {
                "model": model, "mode": mode, "target_ms": target_ms, "wall_s": wall, "estimate_s": guess,
                "trace_suffix": suffix}
            runs.append(trial)
            results.add_arm(row, trial.trace)  # on disk now: a run cut later keeps this arm
            say(f"{label}: {wall:.0f} s, ITL P99 {row.get('itl_p99_ms') or 0:.2f} ms, guarded steps over target "
                f"{(row['guarded_over_target'] or 0) * 100:.0f}%, {row['completed']}/{row['submitted']} requests")
        if runs and runs[0].arm == "unbounded":
            info["agreement"][mode] = output_agreement(runs, "unbounded")
            results.set_model(info)
    backend.close()
    del backend, target
    _free_device()


def _free_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-8b,qwen3-0.6b", help="in run order (the first is the one that matters most)")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--arms", default=ARMS)
    p.add_argument("--profile", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs)")
    p.add_argument("--seed", type=int, default=801)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--target-ms", default="auto")
    p.add_argument("--limit-s", type=float, default=510.0, help="arms that would end past this are left out")
    p.add_argument("--agreement", choices=("auto", "require", "report"), default="auto",
                   help="greedy tokens equal across arms: required in fp32 (auto), where chunking changes no token")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.arms = [a for a in args.arms.split(",") if a]
    if args.arms[0] != "unbounded":
        p.error("the first arm is the baseline and must be unbounded")
    require = args.agreement == "require" or (args.agreement == "auto" and args.dtype in ("float32", "fp32"))
    out = Path(args.out)
    command = " ".join(["dlfp.backends.torch.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    write_config(out, {"gpu_check": vars(args)}, command=command, threads=args.threads)
    results = Results(out, require)
    deadline = Deadline(args.limit_s)
    profile = load_profile(args.profile)
    try:
        for model in [m for m in args.models.split(",") if m]:
            run_model(model, args, profile, results, deadline)
    finally:
        results.flush()
        results.close()
    print(results.report())
    return 1 if results.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
