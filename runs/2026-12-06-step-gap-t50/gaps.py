"""The engine's time between steps (one step's end to the next one's start, pauses of 50 ms
or more left out as idle) per trial, from the step traces, for builds whose bench rows lack
`step_gap_ms_mean`: the bench's own computation (dlfp.bench.analysis._step_stats) over the
steps inside the measured requests' span. Run with the project's venv:
.venv/bin/python gaps.py RUN_DIR [RUN_DIR ...]"""
import re
import sys
from pathlib import Path

from dlfp.bench.analysis import _step_stats
from dlfp.trace import read_requests, read_steps

for run in map(Path, sys.argv[1:]):
    for path in sorted(run.glob("steps-*.jsonl.gz")):
        seed, arm = re.fullmatch(r"steps-(\d+)-(.+)\.jsonl\.gz", path.name).groups()
        measured = [r for r in read_requests(run / f"requests-{seed}-{arm}.jsonl.gz") if r.tag != "warmup"]
        start = min(r.arrival_s for r in measured)
        end = max(r.finished_s or r.arrival_s for r in measured)
        steps = [s for s in read_steps(path) if start <= s.t1 <= end]
        print(f"{run.name} {seed} {arm}: {len(steps)} steps, "
              f"{_step_stats(steps, None)['step_gap_ms_mean']:.3f} ms between steps (mean)")
