"""Background prompt tokens beside the foreground, split by the steps they ran in: guarded
steps, and unguarded steps inside the chats' [arrival, finish] windows (the bench's own
windows for "bg tok/s while a chat streams", dlfp.bench.analysis), and of those the steps
that were in flight when a chat arrived (their prompt tokens, and those cut at it). Run with the project's
venv: .venv/bin/python split.py SEEDS ARM RUN_DIR [RUN_DIR ...], e.g.
.venv/bin/python split.py 1208,1209,1210 dlfp runs/2026-12-06-long-t50 runs/2026-12-06-long-t50-base"""
import sys

from dlfp.bench.analysis import _fg_windows
from dlfp.trace import read_requests, read_steps

seeds, arm = sys.argv[1].split(","), sys.argv[2]
for run in sys.argv[3:]:
    for seed in seeds:
        steps = read_steps(f"{run}/steps-{seed}-{arm}.jsonl.gz")
        chats = [r for r in read_requests(f"{run}/requests-{seed}-{arm}.jsonl.gz") if r.tag == "chat"]
        windows = _fg_windows(chats)
        length = sum(b - a for a, b in windows)
        inside = [s for s in steps if any(a <= s.t1 <= b for a, b in windows)]
        guarded = sum(s.n_prefill_bg for s in inside if s.guarded)
        unguarded = sum(s.n_prefill_bg for s in inside if not s.guarded)
        in_flight = [s for s in inside if not s.guarded and any(s.t0 < r.arrival_s <= s.t1 for r in chats)]
        print(f"{run} {seed} {arm}: windows {length:.1f} s, background tokens in guarded steps {guarded}, "
              f"in unguarded {unguarded}; {(guarded + unguarded) / length:.1f} tok/s "
              f"({guarded / length:.1f} in guarded steps); in flight at an arrival: {len(in_flight)} steps, "
              f"{sum(s.n_prefill_bg for s in in_flight)} background tokens, {sum(s.n_prefill_cut for s in in_flight)} cut")
