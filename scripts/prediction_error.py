"""How far the step-cost model's predictions were from the measured steps, read from the step
traces a run kept: measured / predicted of every guarded step that carried background prompt
tokens and was not cut, split by whether a foreground prompt step came within the three
steps before (the first chunks after a new turn has loaded, when the streams and the
positions the chunks start at change at once) or not.

    .venv/bin/python scripts/prediction_error.py runs/<date>-<name> [runs/<...> ...]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dlfp.trace import read_steps

AFTER_TURN = 3  # steps after a foreground prompt step that count as "after a turn"


def ratios(folder: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"after a turn": [], "other": []}
    for path in sorted(folder.glob("steps-*-dlfp.jsonl.gz")):
        since = AFTER_TURN + 1
        for s in read_steps(path):
            since = 0 if s.n_prefill_fg > 0 else since + 1
            if s.guarded and s.n_prefill_bg > 0 and s.predicted_ms and s.cut_by is None:
                out["after a turn" if since <= AFTER_TURN else "other"].append(s.duration_s * 1e3 / s.predicted_ms)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    args = ap.parse_args()
    print("| run | steps | n | median | P90 | P99 | over 1.2x |\n|---|---|---:|---:|---:|---:|---:|")
    for folder in args.folders:
        for kind, values in ratios(folder).items():
            if values:
                v = np.array(values)
                print(f"| {folder.name} | {kind} | {len(v)} | {np.median(v):.2f} | {np.percentile(v, 90):.2f} | "
                      f"{np.percentile(v, 99):.2f} | {100 * np.mean(v > 1.2):.1f} % |")


if __name__ == "__main__":
    main()
