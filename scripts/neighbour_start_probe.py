"""The ITL another program's start costs a streaming chat, one start at a time, many times.

The noisy-neighbour workload starts its neighbour once a trial, so where in a step it lands
is chance and a bench sees the case a handful of times a day. Here the engine runs the
default model at T (`--itl-target-ms`, 100 by default) with one chat streaming
(300-token replies, back to back) beside two background documents, and a program
spinning on one core starts every 3-4 s (at random; the thread governor returns to both
threads 2 s after other programs' load drops) and stops after `--on-s`; the arms take
turns, a round each. For every start
that lands inside a guarded step on two threads (the governor moves to one thread while the
neighbour runs and back after), it writes the chat's ITL that spans the start, the step in
flight (how far in the start came, its decodes and prompt tokens, whether it was cut and by
what), and per arm the chat's ITL P99 and max over the whole run and the background's
prompt tokens per second. `--policies` takes `dlfp bench` arms, comma-separated.

    .venv/bin/python scripts/neighbour_start_probe.py runs/<yyyy-mm-dd>-neighbour-start \\
        --policies dlfp:cut_at=none,dlfp --rounds 5 --starts 20 --seed 2
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

from dlfp.assembly import build_engine
from dlfp.bench.neighbour import Neighbour
from dlfp.metrics import ITL_GOAL_TOLERANCE, percentile
from dlfp.models import default_model_path
from dlfp.profiles import load_profile
from dlfp.provenance import write_config
from dlfp.sequence import BACKGROUND, FOREGROUND, Request
from dlfp.targets import load_backend
from dlfp.trace import StepRecord
from dlfp.workloads.laptop import load_chat_script, load_documents

WARM_S = 3.0  # the chat streams and the model has learned before the first start
CHAT_TOKENS, DOC_TOKENS = 300, 1500


def span_at(steps: list[StepRecord], gaps: list[tuple[float, float]], s: float) -> dict | None:
    """The chat's ITL (a gap between two of a reply's tokens) that spans `s`, and the step in
    flight then, where that step was guarded and on two threads (None otherwise)."""
    inflight = next((r for r in steps if r.t0 <= s < r.t1), None)
    span = next(((a, b) for a, b in gaps if a <= s < b), None)
    if inflight is None or span is None or not inflight.guarded or inflight.threads != 2:
        return None
    return {"itl_ms": (span[1] - span[0]) * 1e3, "into_step_ms": (s - inflight.t0) * 1e3,
            "n_decode": inflight.n_decode, "n_prefill": inflight.n_prefill_fg + inflight.n_prefill_bg + inflight.n_prefill_cut,
            "cut_by": inflight.cut_by, "step_ms": inflight.duration_s * 1e3, "rule": inflight.rule,
            "decode_ms": inflight.decode_ms}


def run_arm(backend, profile, policy: str, starts: int, on_s: float, target_ms: float,
            rng: random.Random) -> tuple[list[dict], dict]:
    engine = build_engine(backend, policy, profile, itl_target_ms=target_ms)
    docs = [backend.tokenize(d.text)[:DOC_TOKENS] for d in load_documents()]
    chat = backend.tokenize(" ".join(load_chat_script().turns))[:120]
    stop = threading.Event()

    def background(k: int) -> None:
        while not stop.is_set():
            engine.submit(Request(docs[k % len(docs)], 8, BACKGROUND, ignore_eos=True)).result(timeout=120)
            k += 2

    def foreground() -> None:
        while not stop.is_set():
            engine.submit(Request(chat, CHAT_TOKENS, FOREGROUND, ignore_eos=True)).result(timeout=120)

    workers = [threading.Thread(target=f, args=a, daemon=True) for f, a in ((background, (0,)), (background, (1,)), (foreground, ()))]
    for w in workers:
        w.start()
    time.sleep(WARM_S)
    t_begin, times = time.perf_counter(), []
    for _ in range(starts):
        time.sleep(rng.uniform(3.0, 4.0))
        neighbour = Neighbour()
        neighbour.start()
        times.append(neighbour.started_s)
        time.sleep(on_s)
        neighbour.stop()
    time.sleep(0.5)
    t_end = time.perf_counter()
    stop.set()
    engine.shutdown(abort_pending=True)
    steps = [r for r in engine.trace.steps if t_begin <= r.t0 < t_end]
    gaps = [(a, b) for q in engine.trace.requests if q.priority == FOREGROUND
            for a, b in zip(q.token_times, q.token_times[1:]) if t_begin <= a < t_end]
    events = [dict(e, policy=policy) for e in (span_at(steps, gaps, s) for s in times) if e is not None]
    itl = [(b - a) * 1e3 for a, b in gaps]
    whole = {"policy": policy, "starts": starts, "starts_on_two_threads_in_a_guarded_step": len(events),
             "chat_itl_p99_ms": percentile(itl, 99), "chat_itl_max_ms": max(itl, default=None),
             "bg_prefill_tok_s": sum(r.n_prefill_bg for r in steps) / (t_end - t_begin),
             "cut_for_contention": sum(r.cut_by == "contention" for r in steps),
             "cut_at_deadline": sum(r.cut_by == "deadline" for r in steps)}
    return events, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--policies", default="dlfp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--starts", type=int, default=15)
    ap.add_argument("--on-s", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--itl-target-ms", type=float, default=100.0)
    args = ap.parse_args()
    profile, model = load_profile("cpu-laptop"), default_model_path()
    backend = load_backend("llamacpp", str(model), profile, n_threads=2)
    rng, events, wholes = random.Random(args.seed), [], []
    try:
        for r in range(args.rounds):
            for policy in args.policies.split(","):
                ev, whole = run_arm(backend, profile, policy, args.starts, args.on_s, args.itl_target_ms, rng)
                events += [dict(e, round=r) for e in ev]
                wholes.append(dict(whole, round=r))
                print(json.dumps(wholes[-1]), flush=True)
    finally:
        backend.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (args.out / "arms.jsonl").write_text("".join(json.dumps(w) + "\n" for w in wholes))
    write_config(args.out, vars(args) | {"out": str(args.out)}, models=[model], threads=2)
    for policy in args.policies.split(","):
        itls = sorted(e["itl_ms"] for e in events if e["policy"] == policy)
        if itls:
            print(f"{policy}: {len(itls)} starts in a guarded step on two threads; spanning ITL median "
                  f"{percentile(itls, 50):.0f} ms, max {itls[-1]:.0f}; over 1.1 T {sum(x > ITL_GOAL_TOLERANCE * args.itl_target_ms for x in itls)}, "
                  f"over 1.25 T {sum(x > 1.25 * args.itl_target_ms for x in itls)}")


if __name__ == "__main__":
    main()
