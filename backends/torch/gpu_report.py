"""What the torch GPU check leaves under --out, the table it prints, and its verdict.

The device machine brings back at most 8 files, so the check keeps to six:

    config.json     provenance (dlfp.provenance): command, commit, host, versions, the run's arguments
    trials.jsonl    one row per arm measured (the bench's trial row plus step figures)
    table.md        the table and the verdict so far
    models.json     per model: load time, calibration, target, pipeline check, greedy agreement
    traces.tar.gz   every arm's step and request traces (steps-*.jsonl, requests-*.jsonl)
    run.log         the console output (written by scripts/gpu_torch_check.sh)

Every file but config.json and run.log is rewritten after every arm, each through a
temporary name and a rename, so a run cut at its time limit still returns what it
measured, whole.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tarfile
import tempfile
from pathlib import Path

FILES = ("config.json", "trials.jsonl", "table.md", "models.json", "traces.tar.gz", "run.log")


class Results:
    """Rows, per-model records and traces of a run, kept on disk after every change."""

    def __init__(self, out: Path, require_agreement: bool):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.require_agreement = require_agreement
        self.rows: list[dict] = []
        self.models: list[dict] = []
        self.not_run: list[str] = []  # arms left out, with the reason
        self._traces = Path(tempfile.mkdtemp(prefix="dlfp-gpu-traces-"))

    def add_arm(self, row: dict, trace) -> None:
        trace.write(self._traces, row["trace_suffix"])
        self.rows.append(row)
        self.flush(traces=True)

    def set_model(self, info: dict) -> None:
        """Add or replace the record of `info["model"]`."""
        self.models = [m for m in self.models if m["model"] != info["model"]] + [info]
        self.flush()

    def flush(self, traces: bool = False) -> None:
        _replace(self.out / "trials.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in self.rows))
        _replace(self.out / "models.json", json.dumps(self.models, indent=2, default=str) + "\n")
        _replace(self.out / "table.md", self.report() + "\n")
        if traces:
            part = self.out / ".traces.tar.gz.part"
            with tarfile.open(part, "w:gz") as tar:
                for f in sorted(self._traces.iterdir()):
                    tar.add(f, arcname=f.name)
            os.replace(part, self.out / "traces.tar.gz")

    def report(self) -> str:
        """The table, then each model's checks, then the verdict."""
        lines = [table(self.rows), ""]
        for m in self.models:
            check = m.get("pipeline_check")
            if check is not None:
                lines.append(f"launch-ahead vs step-by-step greedy tokens, {m['model']}: "
                             f"{'identical' if check['identical'] else 'DIFFERENT'} ({check['tokens']} tokens)")
            for mode, arms in m.get("agreement", {}).items():
                for arm, a in arms.items():
                    same = a["compared"] - len(a["mismatches"])
                    lines.append(f"greedy agreement {m['model']} {mode} {arm} vs unbounded: {same}/{a['compared']} "
                                 f"requests identical ({'required' if self.require_agreement else 'reported'})")
        bad = self.failures()
        lines.append("")
        lines += [f"FAILED: {f}" for f in bad] or ["all arms completed every request; every required check held"]
        return "\n".join(lines)

    def failures(self) -> list[str]:
        """Why the check fails (empty: it passes)."""
        out = []
        for r in self.rows:
            if r["completed"] < r["submitted"]:
                errors = "; ".join(r.get("errors") or []) or "no error recorded"
                out.append(f"{r['model']} {r['mode']} {r['policy']}: {r['completed']}/{r['submitted']} requests "
                           f"completed ({errors})")
        for m in self.models:
            check = m.get("pipeline_check")
            if check is not None and not check["identical"]:
                out.append(f"{m['model']}: launched ahead, the greedy tokens differ from step-by-step ({check})")
            if not self.require_agreement:
                continue
            for mode, arms in m.get("agreement", {}).items():
                for arm, a in arms.items():
                    if a["mismatches"]:
                        out.append(f"{m['model']} {mode} {arm}: greedy tokens of {len(a['mismatches'])} of "
                                   f"{a['compared']} requests differ from unbounded ({', '.join(a['mismatches'])})")
        out += [f"not run: {x}" for x in self.not_run]
        return out

    def close(self) -> None:
        shutil.rmtree(self._traces, ignore_errors=True)


def _replace(path: Path, text: str) -> None:
    """Write whole or not at all: a run killed mid-write keeps the previous version."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    os.replace(part, path)


def step_figures(trace, target_ms: float) -> dict:
    """Steps that guarded a decode with prompt tokens beside it: their completed time, how
    often it missed the target, and what the policy was fed against that time."""
    guarded = [s for s in trace.steps if s.guarded and s.n_prefill_fg + s.n_prefill_bg > 0]
    over = [s for s in guarded if s.duration_s * 1e3 > target_ms]
    caps = [s.cap for s in guarded if s.cap is not None]
    ratios = [s.observed_s / s.duration_s for s in guarded if s.observed_s and s.duration_s]
    return {
        "guarded_steps": len(guarded),
        "guarded_step_p50_ms": statistics.median(s.duration_s for s in guarded) * 1e3 if guarded else None,
        "guarded_over_target": len(over) / len(guarded) if guarded else None,
        "mean_cap": statistics.fmean(caps) if caps else None,
        "observed_over_completed_p50": statistics.median(ratios) if ratios else None,
    }


def table(rows: list[dict]) -> str:
    """Markdown: per model and mode, each arm against unbounded on the same schedule."""
    head = ("| model | mode | arm | ITL P50 (ms) | ITL P99 (ms) | P99 vs unbounded | TTFT P99 (ms) | guarded step "
            "P50 (ms) | guarded steps over target | mean cap | observed/completed | tokens out/expected "
            "(requests) | wall (s) |")
    lines = [head, "|" + "---|" * 3 + "---:|" * 10]
    base = {(r["model"], r["mode"]): r for r in rows if r["policy"] == "unbounded"}
    for r in rows:
        b = base.get((r["model"], r["mode"]))
        change = "-"
        if b is not None and r is not b and b.get("itl_p99_ms") and r.get("itl_p99_ms") is not None:
            change = f"{(r['itl_p99_ms'] / b['itl_p99_ms'] - 1) * 100:+.1f}%"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['policy']} | {_f(r.get('itl_p50_ms'))} | {_f(r.get('itl_p99_ms'))} | "
            f"{change} | {_f(r.get('ttft_p99_ms'))} | {_f(r.get('guarded_step_p50_ms'), 2)} | "
            f"{_pct(r.get('guarded_over_target'))} | {_f(r.get('mean_cap'), 0)} | "
            f"{_f(r.get('observed_over_completed_p50'), 2)} | {r['output_tokens']}/{r['expected_output_tokens']} "
            f"({r['completed']}/{r['submitted']}) | {_f(r.get('wall_s'), 0)} |")
    return "\n".join(lines)


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"
