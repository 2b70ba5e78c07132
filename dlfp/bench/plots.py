"""`dlfp report DIR`: PNG plots from a `dlfp bench` folder (matplotlib, Agg)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dlfp.metrics import itls
from dlfp.sequence import FOREGROUND
from dlfp.trace import read_requests, read_steps


class PlotError(ValueError):
    pass


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_rows(folder: Path) -> list[dict]:
    path = folder / "trials.jsonl"
    if not path.exists():
        raise PlotError(f"{folder} has no trials.jsonl: not a dlfp bench output folder")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise PlotError(f"{path} is empty: the run wrote no trials")
    return rows


def write_plots(folder: Path) -> list[Path]:
    rows = load_rows(folder)
    target = None
    if (folder / "paired.json").exists():
        paired = json.loads((folder / "paired.json").read_text())
        target = paired.get("itl_target_ms")
    else:
        paired = {}
    plt = _pyplot()
    written = [
        itl_cdf(folder, rows, plt),
        ttft_vs_itl(folder, rows, plt),
    ]
    timeline = dlfp_timeline(folder, rows, plt, target)
    if timeline:
        written.append(timeline)
    sweep = sweep_plot(folder, rows, paired.get("sweep"), plt, target)
    if sweep:
        written.append(sweep)
    return written


def _policies(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["policy"] not in seen:
            seen.append(r["policy"])
    return seen


def _fg_itls(folder: Path, row: dict) -> list[float]:
    recs = read_requests(folder / f"requests-{row['trace_suffix']}.jsonl")
    return [g * 1e3 for r in recs if r.priority == FOREGROUND and r.ok and r.tag != "warmup" for g in itls(r)]


def itl_cdf(folder: Path, rows: list[dict], plt) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in _policies(rows):
        gaps = np.sort([g for r in rows if r["policy"] == policy for g in _fg_itls(folder, r)])
        if gaps.size:
            ax.step(gaps, np.arange(1, gaps.size + 1) / gaps.size, where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("foreground inter-token latency (ms, log)")
    ax.set_ylabel("fraction of gaps <= x")
    ax.set_title("ITL CDF per policy (all seeds)")
    ax.axhline(0.99, color="grey", lw=0.5, ls=":")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return _save(fig, folder / "itl_cdf.png", plt)


def ttft_vs_itl(folder: Path, rows: list[dict], plt) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for policy in _policies(rows):
        pts = [(r["ttft_p99_ms"], r["itl_p99_ms"]) for r in rows
               if r["policy"] == policy and r.get("ttft_p99_ms") is not None and r.get("itl_p99_ms") is not None]
        if pts:
            x, y = zip(*pts)
            ax.scatter(x, y, label=policy)
    ax.set_xlabel("P99 TTFT (ms)")
    ax.set_ylabel("P99 ITL (ms)")
    ax.set_title("TTFT vs P99 ITL, one point per trial")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, folder / "ttft_vs_p99_itl.png", plt)


def dlfp_timeline(folder: Path, rows: list[dict], plt, target_ms: float | None) -> Path | None:
    """The decision timeline of the first seed's DLFP run."""
    row = next((r for r in rows if r["policy"] == "dlfp"), None)
    if row is None:
        return None
    steps = read_steps(folder / f"steps-{row['trace_suffix']}.jsonl")
    if not steps:
        return None
    return decision_timeline(steps, folder / "dlfp_cap_timeline.png", target_ms, f"DLFP run, seed {row['seed']}")


def decision_timeline(steps: list, out: Path, target_ms: float | None, title: str, plt=None) -> Path:
    """Any step trace as three lanes on one time axis: each step's time against the target and
    the setpoint it was planned for; the cap and the prompt tokens that ran; the rule that set
    each guarded step's cap (the decision record)."""
    plt = plt or _pyplot()
    fig, (ax_d, ax_c, ax_r) = plt.subplots(3, 1, figsize=(9, 7), sharex=True,
                                           gridspec_kw={"height_ratios": [3, 2, 1.4]})
    ax_d.scatter([s.t1 for s in steps], [s.duration_s * 1e3 for s in steps], s=4,
                 c=["tab:red" if s.guarded else "tab:grey" for s in steps])
    planned = [s for s in steps if s.guarded and s.setpoint_ms is not None]
    if planned:
        ax_d.step([s.t1 for s in planned], [s.setpoint_ms for s in planned], where="post", lw=0.8,
                  color="tab:green", label="setpoint (target / margin)")
    if target_ms:
        ax_d.axhline(target_ms, color="tab:blue", ls="--", lw=1, label=f"target {target_ms:g} ms")
    if planned or target_ms:
        ax_d.legend(loc="upper right", fontsize=8)
    ax_d.set_yscale("log")
    ax_d.set_ylabel("step time (ms)\nred: foreground decodes")
    guarded = [s for s in steps if s.guarded and s.cap is not None]
    ax_c.step([s.t1 for s in guarded], [s.cap for s in guarded], where="post", label="cap (guarded steps)")
    ran = [s for s in steps if s.n_prefill_fg + s.n_prefill_bg]
    ax_c.scatter([s.t1 for s in ran], [s.n_prefill_fg + s.n_prefill_bg for s in ran], s=4, color="tab:orange",
                 label="prompt tokens in step")
    ax_c.set_yscale("symlog", linthresh=1)
    ax_c.set_ylabel("tokens")
    ax_c.legend(loc="upper right", fontsize=8)
    decided = [s for s in steps if s.guarded and s.rule is not None]
    rules = sorted({s.rule for s in decided})
    for k, rule in enumerate(rules):
        ts = [s.t1 for s in decided if s.rule == rule]
        ax_r.scatter(ts, [k] * len(ts), s=6, marker="|")
    ax_r.set_yticks(range(len(rules)), rules, fontsize=8)
    ax_r.set_ylim(-0.6, max(len(rules), 1) - 0.4)
    ax_r.set_ylabel("rule")
    ax_r.set_xlabel("time since trial start (s)")
    ax_d.set_title(title)
    return _save(fig, out, plt)


def sweep_plot(folder: Path, rows: list[dict], sweep: dict | None, plt, target_ms: float | None) -> Path | None:
    """P99 ITL vs background prefill throughput: each fixed cap, DLFP (and unbounded)."""
    if not sweep:
        return None
    x_metric = sweep["x_metric"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in sweep["points"]:
        pts = [(r.get(x_metric), r.get("itl_p99_ms")) for r in rows if r["policy"] == policy]
        pts = [p for p in pts if None not in p]
        if not pts:
            continue
        x, y = zip(*pts)
        style = {"marker": "*", "s": 140, "color": "tab:red", "zorder": 3} if policy == "dlfp" else {"s": 30}
        ax.scatter(x, y, label=policy, **style)
        ax.annotate(policy, (float(np.mean(x)), float(np.mean(y))), textcoords="offset points", xytext=(5, 5),
                    fontsize=8)
    if target_ms:
        ax.axhline(target_ms, color="tab:blue", ls="--", lw=1, label=f"ITL target {target_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel(f"{x_metric} (prompt tokens/s)")
    ax.set_ylabel("foreground P99 ITL (ms, log)")
    ax.set_title("fixed caps vs DLFP: lower right is better")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, folder / "sweep.png", plt)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
