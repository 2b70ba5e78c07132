"""The terminal tables of `dlfp bench` and `dlfp report`."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from dlfp.bench.paired import HIGHER_IS_BETTER, POINTS, worst_phase_p99
from dlfp.stats import paired_differences, t_interval

TRIAL_COLUMNS = (
    ("ITL p50", "itl_p50_ms"), ("ITL p99", "itl_p99_ms"), ("ITL max", "itl_max_ms"),
    ("stall>1s s", "stall_s_over_1s"), ("TTFT p99", "ttft_p99_ms"),
    ("E2EL p99", "e2el_p99_ms"), ("SLO", "slo_met"), ("goals", "goals_met"), ("bg tok/s", "bg_prefill_tok_s_fg_active"),
    ("bg ptok/s", "bg_prompt_tok_s_client"), ("fg reused", "fg_prompt_tokens_reused"),
    ("TTFT 6-8/1", "ttft_turns_6_8_vs_1"), ("J/tok", "energy_per_output_token_j"),
)
SHOWN_PAIRED = ("itl_p99_ms", "itl_p50_ms", "ttft_p99_ms", "e2el_p99_ms", "goodput", "goodput_fraction",
                "bg_prefill_tok_s_fg_active", "energy_per_output_token_j")


def _fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _pts(x) -> str:
    """A difference of two fractions, in percentage points."""
    return "-" if x is None else f"{x * 100:+.1f} pts"


def trials_table(rows: list[dict], console: Console) -> None:
    table = Table(title="trials: foreground latency in ms; bg tok/s while the foreground is active")
    for col in ("seed", "policy", "ok/sub"):
        table.add_column(col, no_wrap=True)
    columns = [(label, k) for label, k in TRIAL_COLUMNS if any(r.get(k) is not None for r in rows)]  # none: not shown
    for label, _ in columns:
        table.add_column(label, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(str(r["seed"]), r["policy"], f"{r['completed']}/{r['submitted']}",
                      *[_fmt(r.get(k), 3 if k.startswith("energy") else 2 if k.startswith("ttft_turns") else 1)
                        for _, k in columns])
    console.print(table)


def phases_table(rows: list[dict], console: Console, target_ms: float | None = None) -> None:
    """Per phase of a noisy-neighbour run: before, while and after the busy process ran;
    then per arm its worst P99 in any trial and phase against 1.1 T."""
    rows = [r for r in rows if r.get("phases")]
    if not rows:
        return
    table = Table(title="per phase (a busy neighbour process in the middle one): foreground ITL in ms; "
                        "bg tok/s while the foreground is active")
    for col in ("seed", "policy", "phase", "ITL p99", "ITL max", "bg tok/s"):
        table.add_column(col, justify="left" if col in ("policy", "phase") else "right", no_wrap=True)
    for r in rows:
        for name, p in r["phases"].items():
            table.add_row(str(r["seed"]), r["policy"], name, _fmt(p["itl_p99_ms"]), _fmt(p["itl_max_ms"]),
                          _fmt(p["bg_prefill_tok_s_fg_active"]))
    console.print(table)
    for arm in dict.fromkeys(r["policy"] for r in rows):
        p99s = [worst_phase_p99(r) for r in rows if r["policy"] == arm]
        worst = None if None in p99s else max(p99s)
        met = "" if target_ms is None or worst is None else \
            f" ({'<=' if worst <= 1.1 * target_ms else '>'} 1.1 T = {1.1 * target_ms:,.0f} ms)"
        console.print(f"  {arm}: worst P99 ITL in any trial and phase {_fmt(worst)} ms{met}")


def paired_tables(result: dict, console: Console) -> None:
    paired = result["paired"]
    for arm, c in paired["candidates"].items():
        table = Table(title=f"{arm} vs {paired['baseline']}: paired change, mean [95% CI, Student-t df=n-1]")
        table.add_column("metric")
        for s in c["seeds"]:
            table.add_column(f"seed {s}", justify="right")
        table.add_column("mean change [95% CI]", justify="right")
        for m in SHOWN_PAIRED:
            d = c["metrics"].get(m)
            if d is None or all(v is None for v in d["change"]):
                continue
            show, changes, iv = _pct, d["change"], d["interval"]
            if m in POINTS:  # from the paired values, so folders written before POINTS read the same
                show, changes = _pts, paired_differences(d["baseline"], d["candidate"])
                known = [x for x in changes if x is not None]
                iv = t_interval(known).to_dict() if known else None
            ci = "-" if iv is None else show(iv["mean"]) + (
                f" [{show(iv['low'])}, {show(iv['high'])}]" if iv["low"] is not None else " [n=1]")
            table.add_row(m + (" (+ better)" if m in HIGHER_IS_BETTER else ""), *[show(x) for x in changes], ci)
        console.print(table)
        for t in c["trials"]:
            red = "-" if t["reduction"] is None else f"{t['reduction'] * 100:.1f}%"
            console.print(
                f"  seed {t['seed']}: {paired['gate']['metric']} reduction {red}; outputs agree "
                f"{_fmt(t['outputs_agree'])} ({t['requests_compared']} requests compared"
                + (f", {t['unverifiable']} without token ids" if t.get("unverifiable") else "") + "); accounted "
                f"{_fmt(t['reconciled'])}; failed {t['failed']} -> {'pass' if t['pass'] else 'FAIL'}"
            )
        verdict = "[green]PASS[/green]" if c["gate_pass"] else "[red]FAIL[/red]"
        console.print(f"  gate ({paired['gate']['rule']}): {verdict}")


def sweep_lines(result: dict, console: Console) -> None:
    sw = result.get("sweep")
    if not sw or "verdict" not in sw:
        return
    bound = sw.get("bound_ms")
    table = Table(title=f"sweep: P99 ITL vs {sw['x_metric']} (mean [95% CI] over trials); target "
                        f"{_fmt(sw['target_ms'])} ms, met = P99 <= {_fmt(bound)} ms in every trial")
    for col in ("arm", "trials", "P99 ITL (ms)", "worst P99", "worst ITL", "bg tok/s", "met"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for arm, p in sw["points"].items():
        table.add_row(arm, str(p["trials"]), _mean_ci(p["itl_p99_ms"], p["itl_p99_interval"]),
                      _fmt(p["itl_p99_worst_ms"]), _fmt(p["itl_max_worst_ms"]), _mean_ci(p["x"], p["x_interval"]),
                      _fmt(p["meets_every_trial"]))
    console.print(table)
    console.print(f"  verdict: {sw['verdict']}")


def _mean_ci(mean, interval) -> str:
    if mean is None:
        return "-"
    if not interval or interval.get("low") is None:
        return _fmt(mean)
    return f"{mean:,.1f} [{interval['low']:,.1f}, {interval['high']:,.1f}]"


def goodput_lines(result: dict, console: Console) -> None:
    g = result.get("goodput")
    if not g:
        return
    table = Table(title="goodput: foreground requests that met their own goals (TTFT, own P99 ITL <= 1.1 x target); "
                        f"frontier: no other arm has higher goodput and higher {g['x_metric']} in the trial")
    for col in ("arm", "goodput mean [95% CI]", "on frontier", "highest", "missed TTFT / ITL / failed"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for arm, a in g["arms"].items():
        iv = a["interval"]
        ci = f"{a['mean']:.2f}" + (f" [{iv['low']:.2f}, {iv['high']:.2f}]" if iv.get("low") is not None else "")
        m = a.get("missed")
        missed = f"{m['ttft']} / {m['itl']} / {m['failed']}" if m else "-"
        table.add_row(arm, ci, f"{a['on_frontier']}/{a['trials']}", f"{a['highest']}/{a['trials']}", missed)
    console.print(table)
    if "verdict" in g:
        console.print(f"  goodput: {g['verdict']}")


def print_result(rows: list[dict], result: dict, console: Console | None = None) -> None:
    console = console or Console()
    trials_table(rows, console)
    phases_table(rows, console, result.get("itl_target_ms"))
    paired_tables(result, console)
    sweep_lines(result, console)
    goodput_lines(result, console)
