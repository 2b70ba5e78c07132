"""Per arm and seed: guarded steps planned against a tightened target (a reply had spent the
ITLs over T its own P99 absorbs), background tokens in guarded steps, and the chats' replies:
those with an ITL over T, with two or more, and those that failed their ITL goal.
Usage: .venv/bin/python runs/2026-12-07-spent-laptop/spent.py RUN_DIR [RUN_DIR ...]"""
import glob
import gzip
import json
import os
import sys

import numpy as np


def rows(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(dirs):
    for d in dirs:
        config = json.load(open(os.path.join(d, "config.json")))
        # a bench of served arms names no controller of its own: the profile's is the servers'
        target_ms = (config.get("controller") or config["profile"]["controller"])["target_ms"]
        for path in sorted(glob.glob(os.path.join(d, "steps-*.jsonl.gz"))):
            name = os.path.basename(path)[len("steps-"):-len(".jsonl.gz")]
            guarded = [s for s in rows(path) if s.get("guarded") and s.get("cut_ms")]
            # a tightened target shows as a deadline (cut_at x target) at no request's own target
            targets = {target_ms} | {1e3 * r["itl_target_s"] for r in rows(path.replace("steps-", "requests-"))
                                     if r.get("itl_target_s")}
            tight = sum(1 for s in guarded if min(abs(s["cut_ms"] / 1.25 - t) for t in targets) > 1e-6)
            bg = sum(s["n_prefill_bg"] for s in rows(path) if s.get("guarded"))
            replies = [r for r in rows(path.replace("steps-", "requests-"))
                       if r["priority"] == "foreground" and r.get("tag", "").startswith("chat")]
            over, twice, failed = 0, 0, 0
            for r in replies:
                itl = np.diff(r["token_times"]) * 1e3
                if len(itl) == 0:
                    continue
                own_ms = 1e3 * r["itl_target_s"] if r.get("itl_target_s") else target_ms
                n_over = int((itl > own_ms).sum())
                over += n_over >= 1
                twice += n_over >= 2
                failed += float(np.percentile(itl, 99)) > 1.1 * own_ms
            print(f"{os.path.basename(d)} {name}: guarded steps with a chunk cap {len(guarded)}, "
                  f"planned tighter {tight}; bg tokens in guarded steps {bg}; chat replies {len(replies)}: "
                  f"an ITL over T {over}, two or more {twice}, ITL goal failed {failed}")


if __name__ == "__main__":
    main(sys.argv[1:])
