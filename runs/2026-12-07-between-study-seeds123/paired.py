"""SIMULATED. `dlfp` with the rule "between" (runs/2026-12-07-between-study-seeds*, its diff in between.patch) and without it (nobetween: a profile copy with `between = false`) over the study's conditions, seed set by seed set:
conditions met, and background paired where both met (run from the repository root)."""
import json
import math
import statistics
import sys

SETS = ["123", "456", "789", "101112", "131415"]
cand, base = sys.argv[1:3] if len(sys.argv) > 2 else ("between", "nobetween")
ratios, met = [], {cand: 0, base: 0}
for s in SETS:
    try:
        runs = {b: json.load(open(f"runs/2026-12-07-{b}-study-seeds{s}/study.json"))["conditions"] for b in (cand, base)}
    except FileNotFoundError:
        continue
    per = {b: sum(c["summary"]["designs"]["dlfp"]["meets"] for c in runs[b]) for b in runs}
    print(f"seeds {s}: {cand} met {per[cand]}, {base} {per[base]} of {len(runs[cand])}")
    for b in per:
        met[b] += per[b]
    for ca, cb in zip(runs[cand], runs[base]):
        da, db = ca["summary"]["designs"]["dlfp"], cb["summary"]["designs"]["dlfp"]
        if da["meets"] and db["meets"]:
            ratios.append(da["bg_tok_s"] / db["bg_tok_s"])
print(f"in all: {cand} {met[cand]}, {base} {met[base]}; background {cand} / {base} where both met: "
      f"mean {statistics.mean(ratios):.3f}, geometric {math.exp(statistics.mean(map(math.log, ratios))):.3f}, "
      f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} conditions")
