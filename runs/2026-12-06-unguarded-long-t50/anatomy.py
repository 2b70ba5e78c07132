"""Chunk steps of a run's dlfp step traces: how many, how many of 1-2 tokens, the margin's
median and P90, measured / predicted at P50 and P99, and the steps deeper than 700 positions
that ran over 1.3x their prediction. Run with the project's venv:
.venv/bin/python anatomy.py RUN_DIR [RUN_DIR ...]"""
import collections
import glob
import statistics as st
import sys

from dlfp.trace import read_steps

for run in sys.argv[1:]:
    for f in sorted(glob.glob(f"{run}/steps-*-dlfp.jsonl.gz")):
        g = [s for s in read_steps(f) if s.guarded and s.n_prefill_bg > 0 and s.predicted_ms]
        sizes = collections.Counter(s.n_prefill_bg for s in g)
        ratio = [s.duration_s * 1e3 / s.predicted_ms for s in g]
        margin = [s.margin for s in g if s.margin]
        deep = sum(1 for s, x in zip(g, ratio) if (s.position or 0) > 700 and x > 1.3)
        print(f"{run} {f.split('-')[-2]}: chunks {len(g)}, 1-2 tokens {sizes[1] + sizes[2]}, "
              f"margin median {st.median(margin):.2f} P90 {st.quantiles(margin, n=10)[8]:.2f}, "
              f"ratio P50 {st.median(ratio):.2f} P99 {st.quantiles(ratio, n=100)[98]:.2f}, deep over 1.3x {deep}")
