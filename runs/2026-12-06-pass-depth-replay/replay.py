"""Replay committed step traces through the controller's cost model; print, per trace, the
measured / predicted ratios of the chunk steps beside a decode (median, P90, P99), those of
chunks of at most 3 tokens past position 1,000, and the fitted position terms.

    python runs/2026-12-06-pass-depth-replay/replay.py <target_ms> <steps-*.jsonl>...
"""
import json
import sys

import numpy as np

from dlfp.observer import plan_shape
from dlfp.profiles import load_profile
from dlfp.tail import TailDLFP

for path in sys.argv[2:]:
    c = TailDLFP(load_profile("cpu-laptop").controller_params(float(sys.argv[1])))
    ratios, deep = [], []
    for line in open(path):
        r = json.loads(line)
        n, pos = r["n_prefill_fg"] + r["n_prefill_bg"], r.get("position") or 0
        if not r["guarded"]:
            continue
        if n and r["n_decode"] and c.model.ready and r["cut_by"] is None:
            predicted = c.model.predict(n, r["n_decode"], pos + (n - 1) / 2)
            ratios.append(r["duration_s"] * 1e3 / predicted)
            if pos > 1000 and n <= 3:
                deep.append(ratios[-1])
        c.decide(r["n_decode"] or None, position=pos)
        c.observe(r["duration_s"], cap=r["cap"], shape=plan_shape([0] * r["n_decode"], [(pos, n)] if n else []))
    q = lambda v, p: float(np.percentile(v, p)) if v else float("nan")
    print(json.dumps({"trace": path, "chunk_steps": len(ratios), "median": q(ratios, 50), "p90": q(ratios, 90),
                      "p99": q(ratios, 99), "deep_small_steps": len(deep), "deep_small_median": q(deep, 50),
                      "deep_small_p90": q(deep, 90), "j": getattr(c.model, "pass_depth", None), "k": c.model.depth}))
