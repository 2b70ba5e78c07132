"""What fails a reply's own ITL goal (its P99 within 1.1 T) under `dlfp`, from the request
traces of the controller runs of 2026-12-06 and 2026-12-07 (`dlfp` arms of the laptop
workload at T = 100 and T = 50 and beside the neighbour, not the -base runs of 1d43624): how many replies fail it, how many
of those had two or more ITLs over T (a reply of 63 ITLs takes its P99 0.38 of the way from
its second-largest ITL to its largest, so a second ITL near T fails it) against one, and how
much of the foreground's ITLs come after a reply's first ITL over T: the share a rule that
protected such replies for the rest of their stream would plan more tightly. Run from the
repository root with .venv/bin/python."""
import glob
import gzip
import json

from dlfp.metrics import percentile

CONDITIONS = {"T = 100 and beside the neighbour": ("runs/2026-12-0[67]-*-t100", "runs/2026-12-0[67]-*-nn"),
              "T = 50": ("runs/2026-12-0[67]-*-t50",)}
# The law's own runs: not the baselines of 1d43624 (-base), nor the runs kept after this script.
KEPT_AFTER = ("-head-",)

for name, patterns in CONDITIONS.items():
    replies = failed = twice = once = excursion = 0
    after = itls_all = 0
    target_s = 0.05 if name == "T = 50" else 0.1
    runs = sorted({r for p in patterns for r in glob.glob(p) if not r.endswith("-base") and not any(k in r for k in KEPT_AFTER)})
    for run in runs:
        for path in sorted(glob.glob(f"{run}/requests-*-dlfp.jsonl.gz")):
            for line in gzip.open(path, "rt"):
                r = json.loads(line)
                if r["priority"] != "foreground" or r["tag"] == "warmup" or len(r["token_times"]) < 11:
                    continue
                times, t = r["token_times"], r.get("itl_target_s") or target_s
                itls = [b - a for a, b in zip(times, times[1:])]
                over = [i for i, x in enumerate(itls) if x > t]
                replies += 1
                itls_all += len(itls)
                if over:
                    excursion += 1
                    after += len(itls) - over[0] - 1
                if percentile(itls, 99) > 1.1 * t:
                    failed += 1
                    twice += len(over) >= 2
                    once += len(over) < 2
    print(f"{name} ({len(runs)} runs): {replies} replies, {failed} failed their ITL goal "
          f"({100 * failed / replies:.1f} %; two or more ITLs over T: {twice}, one or none: {once}); "
          f"{excursion} ({100 * excursion / replies:.0f} %) had an ITL over T; "
          f"{100 * after / itls_all:.1f} % of all ITLs came after a reply's first ITL over T")
