"""Chunk steps of a run's dlfp step traces: how many, how many of 1-2 tokens, the margin's
median and P90, measured / predicted at P50 and P99, and the steps deeper than 700 positions
that ran over 1.3x their prediction. Usage: python anatomy.py RUN_DIR [RUN_DIR ...]"""
import collections
import glob
import gzip
import json
import statistics as st
import sys

for run in sys.argv[1:]:
    for f in sorted(glob.glob(f"{run}/steps-*-dlfp.jsonl.gz")):
        rows = [json.loads(line) for line in gzip.open(f)]
        g = [r for r in rows if r["guarded"] and r["n_prefill_bg"] > 0 and r["predicted_ms"]]
        sizes = collections.Counter(r["n_prefill_bg"] for r in g)
        ratio = [r["duration_s"] * 1e3 / r["predicted_ms"] for r in g]
        margin = [r["margin"] for r in g if r["margin"]]
        deep = sum(1 for r, x in zip(g, ratio) if (r["position"] or 0) > 700 and x > 1.3)
        print(f"{run} {f.split('-')[-2]}: chunks {len(g)}, 1-2 tokens {sizes[1] + sizes[2]}, "
              f"margin median {st.median(margin):.2f} P90 {st.quantiles(margin, n=10)[8]:.2f}, "
              f"ratio P50 {st.median(ratio):.2f} P99 {st.quantiles(ratio, n=100)[98]:.2f}, deep over 1.3x {deep}")
