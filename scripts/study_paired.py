"""SIMULATED. The `dlfp` design of two builds (or profiles) across `dlfp study` outputs, seed
set by seed set: conditions met by each, and background paired where both met.

    .venv/bin/python scripts/study_paired.py CANDIDATE_STUDY... --against BASELINE_STUDY...

Each argument is a study.json (or .json.gz) that `dlfp study --out` wrote; the two lists
pair up in order (the same seeds and conditions on each side).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from pathlib import Path


def conditions(path: Path) -> list[dict]:
    """The `dlfp` design's summary for each condition, in the study's order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [c["summary"]["designs"]["dlfp"] for c in json.load(f)["conditions"]]


def compare(candidates: list[Path], baselines: list[Path]) -> list[str]:
    lines, ratios, met, total = [], [], [0, 0], 0
    for cand, base in zip(candidates, baselines, strict=True):
        a, b = conditions(cand), conditions(base)
        if len(a) != len(b):
            raise SystemExit(f"{cand} and {base} hold different conditions ({len(a)} against {len(b)})")
        here = [sum(d["meets"] for d in a), sum(d["meets"] for d in b)]
        lines.append(f"{cand.name}: met {here[0]}, {base.name} {here[1]} of {len(a)}")
        met, total = [met[0] + here[0], met[1] + here[1]], total + len(a)
        ratios += [da["bg_tok_s"] / db["bg_tok_s"] for da, db in zip(a, b) if da["meets"] and db["meets"]]
    summary = f"in all: candidate {met[0]}, baseline {met[1]} of {total}"
    if ratios:
        summary += (f"; background candidate / baseline where both met: geometric "
                    f"{math.exp(statistics.mean(map(math.log, ratios))):.3f}, "
                    f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} conditions")
    return lines + [summary]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidate", nargs="+", type=Path)
    ap.add_argument("--against", nargs="+", type=Path, required=True, help="the baseline's studies, in the same order")
    args = ap.parse_args()
    print("\n".join(compare(args.candidate, args.against)))


if __name__ == "__main__":
    main()
