"""MLC step mode: apache-tvm's plain CPU pipeline vs the dlight build, same random weights, one run.

    .venv/bin/python scripts/mlc_schedule_bench.py --layers 2 --vocab 4096 --threads 2   # SmolLM2-shaped layers, ~1.5 min

Builds the tiny MLC model at SmolLM2's layer shape twice (--schedule none, dlight), then
times decode steps (one sequence, 64 tokens of context) and 32-token prefill steps on
each, medians, and prints the largest logit difference over the spread (0: same sums).
"""
import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from dlfp.backends.mlc.build_tiny import SCHEDULES, build_tiny
from dlfp.backends.mlc.step import MLCStepBackend, StepConfig
from dlfp.protocol import DecodeItem, Limits, PrefillChunk, StepPlan


def measure(folder: Path, threads: int, reps: int) -> tuple[dict, np.ndarray]:
    b = MLCStepBackend(StepConfig(str(folder), Limits(2, 2048, 256), n_threads=threads))
    try:
        ids = [int(t) for t in np.random.default_rng(0).integers(3, 259, 64)]
        b.step(StepPlan(prefills=[PrefillChunk(0, ids, 0, True)]))
        dec = []
        for i in range(reps + 1):
            r = b.step(StepPlan(decodes=[DecodeItem(0, 5 + i, 64 + i)]))
            dec.append(r.duration_s)
        row = np.asarray(r.logits[0])
        pre = []
        for _ in range(3):
            b.free_sequence(1)
            pre.append(b.step(StepPlan(prefills=[PrefillChunk(1, ids[:32], 0, True)])).duration_s)
    finally:
        b.close()
    return {"decode_ms": 1e3 * statistics.median(dec[1:]), "prefill32_ms": 1e3 * statistics.median(pre)}, row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results JSON here too")
    args = ap.parse_args()
    shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, vocab_size=args.vocab, context_window_size=2048)
    result, rows = {"shape": shape, "threads": args.threads}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for sched in SCHEDULES:
            build_tiny(Path(tmp) / sched, 0, sched, **shape)
            result[sched], rows[sched] = measure(Path(tmp) / sched, args.threads, args.reps)
    ref = rows["none"]
    result["logit_gap_share"] = float(np.abs(rows["dlight"] - ref).max() / np.ptp(ref))
    result["decode_speedup"] = result["none"]["decode_ms"] / result["dlight"]["decode_ms"]
    result["prefill_speedup"] = result["none"]["prefill32_ms"] / result["dlight"]["prefill32_ms"]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
