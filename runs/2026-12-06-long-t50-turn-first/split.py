"""Background prompt tokens beside the foreground, split by the steps they ran in: guarded
steps, and unguarded steps inside a chat's [arrival, finish] (the windows the bench's "bg tok/s
while a chat streams" is taken over). Usage: python split.py SEEDS ARM RUN_DIR [RUN_DIR ...],
e.g. python split.py 1208,1209,1210 dlfp runs/2026-12-06-long-t50 runs/2026-12-06-long-t50-base"""
import gzip
import json
import sys


def load(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path)]
    except FileNotFoundError:
        return [json.loads(line) for line in gzip.open(path + ".gz")]


seeds, arm = sys.argv[1].split(","), sys.argv[2]
for run in sys.argv[3:]:
    for seed in seeds:
        steps, reqs = load(f"{run}/steps-{seed}-{arm}.jsonl"), load(f"{run}/requests-{seed}-{arm}.jsonl")
        windows: list[list[float]] = []
        for a, b in sorted((r["arrival_s"], r["finished_s"]) for r in reqs if r["tag"] == "chat"):
            if windows and a <= windows[-1][1]:
                windows[-1][1] = max(windows[-1][1], b)
            else:
                windows.append([a, b])
        length = sum(b - a for a, b in windows)
        inside = [s for s in steps if any(a <= s["t1"] <= b for a, b in windows)]
        guarded = sum(s["n_prefill_bg"] for s in inside if s["guarded"])
        unguarded = sum(s["n_prefill_bg"] for s in inside if not s["guarded"])
        print(f"{run} {seed} {arm}: windows {length:.1f} s, background tokens in guarded steps {guarded}, "
              f"in unguarded {unguarded}; {(guarded + unguarded) / length:.1f} tok/s "
              f"({guarded / length:.1f} in guarded steps)")
