"""How soon a new turn's first token could come while every step beside the streaming chats
stays within the target, read from the traces of a served multi-turn run (`dlfp bench
--workload multi-turn-ingest` with a `dlfp` and a `llama-server` arm, as
scripts/llama_server_bench.sh runs it).

A new turn (turns 2-8) that arrives while d chats stream must load its N new prompt tokens
in steps that each carry the d decodes and end within T: at most
n_max = floor((T - b_d) / t) tokens a step, so at least k = ceil(N / n_max) steps and
k * b_d + N * t of compute before its first token, whatever the scheduler. b_d is the
trial's median decode-only step with d decodes, t the median (L - b_d) / n of its steps
that carried n >= 4 tokens of a new turn (and no background) beside d decodes, both from
the `dlfp` arm's uncut guarded steps on the full thread count. It leaves out the wait for the step in flight at arrival; it is an
estimate from median costs, not a strict bound (a turn's steps may run faster than the
median, and a stream may end while it loads). llama.cpp's server loads the turn in one
step that every stream waits for.

    .venv/bin/python scripts/turn_bound.py runs/<date>-<name> [runs/<...> ...]
"""
from __future__ import annotations

import argparse
import bisect
import math
import statistics
from pathlib import Path

from dlfp.metrics import ttft
from dlfp.trace import RequestRecord, StepRecord, read_requests, read_steps

MIN_CHUNK = 4  # tokens: a smaller chunk's time is mostly its pass, not its tokens
MIN_STEPS = 5  # steps of a shape before its median is taken as its cost


def step_costs(steps: list[StepRecord]) -> dict[int, tuple[float, float]]:
    """d -> (b_d, t) in ms, for each decode count with enough steps of both kinds."""
    full = max(s.threads or 0 for s in steps)
    costs = {}
    for d in sorted({s.n_decode for s in steps if s.n_decode > 0}):
        ok = [s for s in steps if s.guarded and s.n_decode == d and not s.n_prefill_cut and (s.threads or 0) == full]
        alone = [s.duration_s * 1e3 for s in ok if s.n_prefill_fg + s.n_prefill_bg == 0]
        if len(alone) < MIN_STEPS:
            continue
        base = statistics.median(alone)
        per_token = [(s.duration_s * 1e3 - base) / s.n_prefill_fg for s in ok
                     if s.n_prefill_fg >= MIN_CHUNK and not s.n_prefill_bg]
        if len(per_token) >= MIN_STEPS:
            costs[d] = (base, statistics.median(per_token))
    return costs


def new_turns(requests: list[RequestRecord]) -> dict[str, RequestRecord]:
    return {r.request_id: r for r in requests
            if r.tag == "chat" and not r.request_id.endswith("-t0") and r.token_times}


def turn_rows(folder: Path, seed: str, target_ms: float) -> list[dict]:
    steps = read_steps(folder / f"steps-{seed}-dlfp.jsonl.gz")
    mine = new_turns(read_requests(folder / f"requests-{seed}-dlfp.jsonl.gz"))
    server = new_turns(read_requests(folder / f"requests-{seed}-llama-server.jsonl.gz"))
    costs, starts = step_costs(steps), [s.t0 for s in steps]
    rows = []
    for rid, r in sorted(mine.items()):
        if rid not in server:
            continue
        loading = steps[bisect.bisect_left(starts, r.arrival_s):bisect.bisect_right(starts, r.token_times[0])]
        d = max((s.n_decode for s in loading if s.n_prefill_fg), default=0)  # chats streaming beside it
        n = r.prompt_len - r.cached_prompt_tokens
        bound = None
        if d in costs:
            base, token = costs[d]
            per_step = max(1, math.floor((target_ms - base) / token))
            bound = math.ceil(n / per_step) * base + n * token
        rows.append({"seed": seed, "turn": rid, "decodes": d, "new_tokens": n, "dlfp": ttft(r) * 1e3,
                     "bound": bound, "llama_server": ttft(server[rid]) * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--target-ms", type=float, default=100.0)
    args = ap.parse_args()
    print("| run | seed | turns | beside a stream | median TTFT, all turns: dlfp / llama-server (ms) "
          "| beside a stream: dlfp / estimate / llama-server (ms) | under the estimate: dlfp / llama-server |"
          "\n|---|---|---:|---:|---:|---:|---:|")
    for folder in args.folders:
        seeds = sorted({p.name.split("-")[1] for p in folder.glob("requests-*-llama-server.jsonl.gz")})
        for seed in seeds:
            rows = turn_rows(folder, seed, args.target_ms)
            beside = [r for r in rows if r["bound"] is not None]
            med = lambda key, rs: f"{statistics.median(r[key] for r in rs):.0f}" if rs else "-"
            print(f"| {folder.name} | {seed} | {len(rows)} | {len(beside)} | {med('dlfp', rows)} / "
                  f"{med('llama_server', rows)} | {med('dlfp', beside)} / {med('bound', beside)} / "
                  f"{med('llama_server', beside)} | {sum(r['dlfp'] < r['bound'] for r in beside)} / "
                  f"{sum(r['llama_server'] < r['bound'] for r in beside)} |")


if __name__ == "__main__":
    main()
