"""Terminal tables for run summaries."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.1f}"
    return str(x)


def laptop_table(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    pol = summary["policies"]
    table = Table(title=f"laptop job: ITL target {summary['itl_target_ms']:.0f} ms, "
                        f"decode-only ITL {_fmt(summary['decode_only_itl_ms'])} ms")
    table.add_column("metric")
    for name in pol:
        table.add_column(name, justify="right")
    rows = [
        ("fg ITL P50 (ms)", "fg_itl_p50_ms"),
        ("fg ITL P99 (ms)", "fg_itl_p99_ms"),
        ("fg ITL max (ms)", "fg_itl_max_ms"),
        ("fg TTFT P99 (ms)", "fg_ttft_p99_ms"),
        ("bg prefill tok/s", "bg_prefill_tokens_per_s"),
        ("bg docs done", "bg_docs_done"),
        ("requests failed", "requests_failed"),
        ("zero-cap steps", "zero_cap_steps"),
        ("steps on fewer threads", "reduced_thread_steps"),
        ("wall (s)", "wall_s"),
    ]
    for label, key in rows:
        table.add_row(label, *[_fmt(p.get(key)) for p in pol.values()])
    table.add_row("fg TTFT by turn (ms)", *[" ".join(_fmt(x) for x in p.get("fg_ttft_by_turn_ms", [])) or "-"
                                           for p in pol.values()])
    table.add_row("fg prompt tokens reused", *[f"{p.get('fg_prompt_tokens_reused', 0)}/{p.get('fg_prompt_tokens', 0)}"
                                               for p in pol.values()])
    table.add_row("energy J/out token", *[_fmt(p["energy"].get("j_per_output_token")) for p in pol.values()])
    table.add_row("peak temp (C)", *[_fmt(p["energy"].get("peak_temp_c")) for p in pol.values()])
    console.print(table)
    console.print(f"exact output match: {summary['exact_output_match']}")
    for note in summary.get("notes", []):
        console.print(f"[bold red]{note}[/bold red]")
    for name, p in pol.items():
        for note in p["notes"]:
            console.print(f"[yellow]{name}: {note}[/yellow]")
