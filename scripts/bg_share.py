"""Background prompt tokens per second while a chat is in flight, counted two ways, from a
run folder's traces (so runs of any build, whatever its bench computed, compare alike):

- at the step's end, as the bench's `bg_prefill_tok_s_fg_active`: a step counts whole
  toward a chat's window if it completed inside it;
- by time share, as the bench's `bg_prefill_tok_s_fg_share`: each step's tokens by the
  share of its time inside the windows.

They differ by the background steps in flight when a chat arrives: counted at the end,
a long one that ran mostly before the arrival counts whole; an engine that cuts it at the
arrival (dlfp on llama.cpp: the chat starts at once) loses it there under both.

    .venv/bin/python scripts/bg_share.py RUN [BASE] [--arm dlfp] [--base-arm dlfp]

With BASE, per seed the ratio RUN / BASE under each accounting.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from dlfp.bench.analysis import _fg_windows, _rate, share_rate
from dlfp.trace import read_requests, read_steps
from dlfp.sequence import FOREGROUND

WARMUP = "warmup"  # the bench's warm-up requests: not measured


def rates(run: Path, seed: str, arm: str) -> tuple[float | None, float | None]:
    """(at the end, by time share) for one trial's traces."""
    steps = read_steps(run / f"steps-{seed}-{arm}.jsonl.gz")
    fg = [r for r in read_requests(run / f"requests-{seed}-{arm}.jsonl.gz")
          if r.priority == FOREGROUND and r.tag != WARMUP]
    windows = _fg_windows(fg)
    return _rate(steps, ("n_prefill_bg",), windows), share_rate(steps, windows)


def seeds_of(run: Path, arm: str) -> list[str]:
    found = (re.fullmatch(rf"steps-(\d+)-{re.escape(arm)}\.jsonl\.gz", p.name) for p in run.iterdir())
    return sorted((m.group(1) for m in found if m), key=int)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("base", type=Path, nargs="?")
    ap.add_argument("--arm", default="dlfp")
    ap.add_argument("--base-arm", default="dlfp")
    a = ap.parse_args()
    for run, arm in ((a.run, a.arm), (a.base, a.base_arm)):
        if run is not None and not (run.is_dir() and seeds_of(run, arm)):
            ap.error(f"{run}: no steps-<seed>-{arm}.jsonl.gz traces (a `dlfp bench` output folder and its arm)")
    print("| seed | at the end (tok/s) | by time share (tok/s) |" if a.base is None else
          "| seed | at the end: run / base (tok/s, ratio) | by time share: run / base (tok/s, ratio) |")
    print("|---|---:|---:|")
    ratios: tuple[list[float], list[float]] = ([], [])
    for seed in seeds_of(a.run, a.arm):
        end, share = rates(a.run, seed, a.arm)
        if a.base is None:
            print(f"| {seed} | {_f(end)} | {_f(share)} |")
            continue
        if not (a.base / f"steps-{seed}-{a.base_arm}.jsonl.gz").exists():
            continue
        b_end, b_share = rates(a.base, seed, a.base_arm)
        cells = []
        for mine, theirs, out in ((end, b_end, ratios[0]), (share, b_share, ratios[1])):
            r = _ratio(mine, theirs)
            if r is not None:
                out.append(r)
            cells.append(f"{_f(mine)} / {_f(theirs)} ({_f(r, '.2f')}x)")
        print(f"| {seed} | {cells[0]} | {cells[1]} |")
    for name, rs in zip(("at the end", "by time share"), ratios):
        if rs:
            print(f"- {name}: mean {sum(rs) / len(rs):.3f}x, lowest {min(rs):.2f}x over {len(rs)} trials")


if __name__ == "__main__":
    main()
