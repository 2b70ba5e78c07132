"""Packed vs per-sequence ExecuTorch layout, side by side in one run: step time and memory.

    .venv/bin/python scripts/et_packed_bench.py --out runs/et-packed.json            # tiny model (~2 min CPU)
    .venv/bin/python scripts/et_packed_bench.py --per-seq smollm2.pte --packed smollm2-packed.pte

Step time: k decoding sequences (k = 1, 2, 4; 1, 2, 3 for a 4-slot packed program) plus one
32-token chunk in another slot,
the same plan sent to both layouts, alternating which goes first, medians of
`StepResult.duration_s` (the worker's wall time around its execute calls). On a
loaded machine only the ratio means anything: both layouts see the same load.
Memory: RSS and USS of each backend's worker process with 4 slots loaded and every
slot's cache and arena touched once (the per-sequence layout loads one Program per slot).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import psutil

from dlfp.backends.executorch import ExecuTorchBackend, ExecuTorchConfig
from dlfp.backends.executorch_export import TinyConfig, export_tiny
from dlfp.protocol import DecodeItem, Limits, PrefillChunk, StepPlan

TINY = dict(dim=64, layers=2, heads=4, ffn=128, max_seq_len=512, max_chunk=160, seed=0)  # tests/tiny_pte.py's
DECODERS = (1, 2, 4)
CHUNK = 32
PROMPT = 64  # context each decoding sequence holds before the timed steps
RSS_SLOTS = 4


def _ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def _backend(pte: Path, slots: int, threads: int) -> ExecuTorchBackend:
    return ExecuTorchBackend(ExecuTorchConfig(str(pte), Limits(slots, 4096, 256), n_threads=threads))


def decoder_counts(packed_slots: int) -> tuple[int, ...]:
    """Decoding sequences per timed step: each plan also needs a free slot for the chunk."""
    if packed_slots < 2:
        raise SystemExit(f"the packed program holds {packed_slots} slot(s): at least 2 are needed")
    ks = [k for k in DECODERS if k < packed_slots]
    if packed_slots - 1 not in ks and packed_slots - 1 < max(DECODERS):
        ks.append(packed_slots - 1)
    return tuple(ks)


def step_times(backends: dict, reps: int, decoders: tuple[int, ...] = DECODERS) -> dict:
    out = {}
    for k in decoders:
        chunk_slot = k  # decodes in slots 0..k-1, the chunk in slot k
        for b in backends.values():
            for s in range(k + 1):
                b.free_sequence(s)
            for s in range(k):
                b.step(StepPlan(prefills=[PrefillChunk(s, _ids(PROMPT, s), 0, True)]))
        times = {name: [] for name in backends}
        for rep in range(reps + 1):
            plan = StepPlan(decodes=[DecodeItem(s, 3 + (rep + s) % 256, PROMPT + rep) for s in range(k)],
                            prefills=[PrefillChunk(chunk_slot, _ids(CHUNK, 100 + rep), 0, True)])
            order = list(backends) if rep % 2 == 0 else list(backends)[::-1]
            for name in order:
                backends[name].free_sequence(chunk_slot)
                r = backends[name].step(plan)
                if rep:  # the first round warms both
                    times[name].append(r.duration_s)
        med = {name: statistics.median(t) for name, t in times.items()}
        out[f"{k}_decodes+{CHUNK}_chunk"] = {
            "median_s": med, "per_sequence_over_packed": med["per-sequence"] / med["packed"], "n": reps}
    return out


def memory(per_seq: Path, packed: Path, threads: int) -> dict:
    out = {}
    for name, pte in (("per-sequence", per_seq), ("packed", packed)):
        b = _backend(pte, RSS_SLOTS, threads)
        try:
            b.step(StepPlan(prefills=[PrefillChunk(s, _ids(CHUNK, s), 0, True) for s in range(RSS_SLOTS)]))
            mem = psutil.Process(b._proc.pid).memory_full_info()
            out[name] = {"rss_mb": mem.rss / 1e6, "uss_mb": mem.uss / 1e6}
        finally:
            b.close()
    out["per_sequence_over_packed_rss"] = out["per-sequence"]["rss_mb"] / out["packed"]["rss_mb"]
    out["per_sequence_over_packed_uss"] = out["per-sequence"]["uss_mb"] / out["packed"]["uss_mb"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/et-packed.json")
    ap.add_argument("--per-seq", type=Path, help="a per-sequence .pte (default: export the tiny model)")
    ap.add_argument("--packed", type=Path, help="a packed .pte (5 slots time 1, 2, 4 decodes; 4 slots 1, 2, 3; default: export the tiny model)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        per_seq, packed = args.per_seq, args.packed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if per_seq is None:
                per_seq = export_tiny(Path(tmp) / "tiny.pte", TinyConfig(**TINY))
            if packed is None:
                packed = export_tiny(Path(tmp) / "tiny-packed.pte", TinyConfig(**TINY, slots=max(DECODERS) + 1))
        meta = json.loads(Path(str(packed) + ".json").read_text())
        decoders = decoder_counts(int(meta["slots"]))
        slots = max(decoders) + 1
        per_seq_delegation = json.loads(Path(str(per_seq) + ".json").read_text()).get("delegation")
        backends = {"per-sequence": _backend(per_seq, slots, args.threads), "packed": _backend(packed, slots, args.threads)}
        try:
            t0 = time.perf_counter()
            steps = step_times(backends, args.reps, decoders)
            wall = time.perf_counter() - t0
        finally:
            for b in backends.values():
                b.close()
        mem = memory(per_seq, packed, args.threads)
    result = {
        "what": "ExecuTorch packed layout vs per-sequence layout, same plans, alternating, medians",
        "model": meta.get("model", {}), "packed_program_slots": meta["slots"], "threads": args.threads,
        "delegation_packed": meta["delegation"],
        "delegation_per_sequence": per_seq_delegation,
        "step_time": steps, "memory_4_slots": mem, "timing_wall_s": wall,
        "host": platform.node(), "cpus": psutil.cpu_count(), "load_avg": list(psutil.getloadavg()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({"step_time": steps, "memory_4_slots": mem}, indent=2))


if __name__ == "__main__":
    main()
