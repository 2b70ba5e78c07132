"""How late a deadline cut takes effect: a step's duration less its decision's cut_ms, for every
step cut at its deadline in the step traces of runs/2026-12-04-* to runs/2026-12-07-*.
    .venv/bin/python runs/2026-12-07-late-cuts/late_cuts.py > runs/2026-12-07-late-cuts/results.txt"""
import glob
import statistics

from dlfp.trace import read_steps

late = []
LATER = "runs/2026-12-07-faster-"  # runs kept after this was run: not in its results.txt
for f in sorted(f for f in glob.glob("runs/2026-12-0[4567]-*/steps-*.jsonl.gz") if not f.startswith(LATER)):
    for s in read_steps(f):
        if s.cut_by == "deadline" and s.cut_ms:
            late.append((s.duration_s * 1e3 - s.cut_ms, s.threads, f.split("/")[1]))
for threads in (1, 2):
    v = sorted(x[0] for x in late if x[1] == threads)
    print(f"{threads} thread(s): {len(v)} deadline cuts, median {statistics.median(v):.1f} ms late, "
          f"over 10 ms late {sum(x > 10 for x in v)}, over 30 ms {sum(x > 30 for x in v)}, latest {v[-1]:.1f} ms")
