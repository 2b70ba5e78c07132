"""What a prompt token costs at different positions of its context, on the real llama.cpp backend.

One chat decodes (one sequence at position ~300) while a document is loaded to position p and
then advanced a chunk a step beside the decode (each size in --chunks in turn), alternating
with decode-only steps; the median step time of each kind is printed per p and size. The
step-cost model's law (`dlfp/stepcost.py`) is then fitted to the medians, L - a = s + u t
(1 + k p) with u = size - 1 tokens at mean position p: k, what each position adds to a
prompt token's cost as a share of it, is what the controller's model fits online (two sizes
are needed: one cannot tell a token's cost from the pass's).

    .venv/bin/python scripts/position_cost_probe.py --out runs/<date>-position-cost
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import numpy as np

from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from dlfp.models import default_model_path
from dlfp.protocol import DecodeItem, Limits, PrefillChunk, StepPlan
from dlfp.provenance import write_config


def probe(backend: LlamaCppBackend, positions: list[int], chunks: list[int], repeats: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tokens = [rng.randrange(100, 40000) for _ in range(max(positions) + sum(chunks) * repeats + 1)]
    backend.step(StepPlan(prefills=[PrefillChunk(0, tokens[:300], 0, True)]))
    decode_at, rows = 300, []
    for p in positions:
        backend.free_sequence(1)
        for start in range(0, p, 512):
            k = min(512, p - start)
            backend.step(StepPlan(prefills=[PrefillChunk(1, tokens[start:start + k], start, False)]))
        at = p
        for chunk in chunks:
            times: dict[int, list[float]] = {0: [], chunk: []}
            start = at
            for n in (0, chunk) * repeats:
                prefills = [PrefillChunk(1, tokens[at:at + n], at, False)] if n else []
                times[n].append(backend.step(StepPlan([DecodeItem(0, 42, decode_at)], prefills)).duration_s * 1e3)
                decode_at, at = decode_at + 1, at + n
            rows.append({"position": p, "chunk": chunk, "mean_position": (start + at - 1) / 2,
                         "decode_only_ms": statistics.median(times[0]),
                         "chunk_beside_decode_ms": statistics.median(times[chunk])})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def fit(rows: list[dict]) -> dict:
    """Least squares of the step-cost law over the medians: s, t (ms) and k (per position)."""
    x = np.array([[1.0, r["chunk"] - 1, (r["chunk"] - 1) * r["mean_position"]] for r in rows])
    y = np.array([r["chunk_beside_decode_ms"] - r["decode_only_ms"] for r in rows])
    (s, t, tk), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {"seq_ms": float(s), "token_ms": float(t), "depth": float(tk / t),
            "residual_ms": [float(v) for v in y - x @ np.array([s, t, tk])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", type=int, nargs="+", default=[16, 256, 768, 1536])
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    model = default_model_path()
    backend = LlamaCppBackend(LlamaCppConfig(str(model), limits=Limits(4, 4096, 512), n_threads=args.threads))
    rows = probe(backend, args.positions, args.chunks, args.repeats, seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "positions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if len(set(args.chunks)) > 1:
        fitted = fit(rows)
        (args.out / "fit.json").write_text(json.dumps(fitted, indent=2) + "\n")
        print(json.dumps(fitted))
    write_config(args.out, {"chunks": args.chunks, "repeats": args.repeats, "seed": 0}, models=[model],
                 threads=args.threads)


if __name__ == "__main__":
    main()
