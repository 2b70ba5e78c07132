"""SIMULATED. `dlfp` with realized_memory = 1000 (realized.patch on 9ced78a) against the law,
over the study's 16 conditions on seeds 1-9 in three sets: conditions met, and background
paired where both met (run from the repository root)."""
import gzip
import json
import math
import statistics

HERE = "runs/2026-12-07-realized-study"
ratios, met = [], {"real": 0, "base": 0}
for s in ("123", "456", "789"):
    runs = {b: json.load(gzip.open(f"{HERE}/study-{b}-seeds{s}.json.gz"))["conditions"] for b in met}
    per = {b: sum(c["summary"]["designs"]["dlfp"]["meets"] for c in runs[b]) for b in runs}
    print(f"seeds {s}: realized_memory=1000 met {per['real']}, the law {per['base']} of {len(runs['real'])}")
    for b in per:
        met[b] += per[b]
    for ca, cb in zip(runs["real"], runs["base"]):
        da, db = ca["summary"]["designs"]["dlfp"], cb["summary"]["designs"]["dlfp"]
        if da["meets"] and db["meets"]:
            ratios.append(da["bg_tok_s"] / db["bg_tok_s"])
print(f"in all: realized_memory=1000 {met['real']}, the law {met['base']} of 48; background realized / law where "
      f"both met: geometric {math.exp(statistics.mean(map(math.log, ratios))):.3f}, "
      f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} conditions")
