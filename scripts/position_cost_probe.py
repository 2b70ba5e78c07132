"""What a prompt token costs at different positions of its context, on the real llama.cpp backend.

One chat decodes (one sequence at position ~300) while a document is loaded to position p and
then advanced 10 tokens a step beside the decode, alternating with decode-only steps; the
median step time of each kind is printed per p. The step-cost model's position term
(`dlfp/stepcost.py`, k) is what this shows.

    .venv/bin/python scripts/position_cost_probe.py --out runs/<date>-position-cost
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from dlfp.models import default_model_path
from dlfp.protocol import DecodeItem, Limits, PrefillChunk, StepPlan
from dlfp.provenance import write_config


def probe(backend: LlamaCppBackend, positions: list[int], chunk: int, repeats: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tokens = [rng.randrange(100, 40000) for _ in range(max(positions) + chunk * repeats + 1)]
    backend.step(StepPlan(prefills=[PrefillChunk(0, tokens[:300], 0, True)]))
    decode_at, rows = 300, []
    for p in positions:
        backend.free_sequence(1)
        for start in range(0, p, 512):
            k = min(512, p - start)
            backend.step(StepPlan(prefills=[PrefillChunk(1, tokens[start:start + k], start, False)]))
        at, times = p, {0: [], chunk: []}
        for n in (0, chunk) * repeats:
            prefills = [PrefillChunk(1, tokens[at:at + n], at, False)] if n else []
            times[n].append(backend.step(StepPlan([DecodeItem(0, 42, decode_at)], prefills)).duration_s * 1e3)
            decode_at, at = decode_at + 1, at + n
        rows.append({"position": p, "decode_only_ms": statistics.median(times[0]),
                     f"chunk_{chunk}_beside_decode_ms": statistics.median(times[chunk])})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", type=int, nargs="+", default=[16, 256, 768, 1536])
    ap.add_argument("--chunk", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    model = default_model_path()
    backend = LlamaCppBackend(LlamaCppConfig(str(model), limits=Limits(4, 4096, 512), n_threads=args.threads))
    rows = probe(backend, args.positions, args.chunk, args.repeats, seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "positions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_config(args.out, {"chunk": args.chunk, "repeats": args.repeats, "seed": 0}, models=[model],
                 threads=args.threads)


if __name__ == "__main__":
    main()
