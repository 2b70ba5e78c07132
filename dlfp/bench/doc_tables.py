"""The tables of the README and docs/, generated from kept runs (`dlfp report --docs`).

A table in a Markdown file sits between two markers that name its source folder
(relative to the repository root) and how to draw it:

    <!-- dlfp-report runs/2026-12-02-sweep-t100 sweep -->
    (generated: the table, its verdict lines, and a source line from config.json)
    <!-- /dlfp-report -->

`rewrite_text` redraws every block from its folder, so a figure typed by hand
into a block is overwritten, and the docs test (tests/test_docs_tables.py) fails
while any block differs from what its folder gives. Each kind reads only the
files a run writes (summary.json, trials.jsonl, the soak and check-model JSON),
so a new run of the same command regenerates its table.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from statistics import median
from typing import Callable

from dlfp.bench.paired import (FG_ACTIVE_BG, TARGET_TOLERANCE, background_metric, goodput_summary, sweep_summary,
                               worst_phase_p99)
from dlfp.runs import load_config
from dlfp.stats import paired_changes, t_interval

MARKER = re.compile(r"(<!-- dlfp-report (\S+) ([a-z-]+) -->\n)(.*?)(<!-- /dlfp-report -->)", re.S)
DOC_FILES = ("README.md", "docs/*.md")


# -- formatting ----------------------------------------------------------------
def _n(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _share(x: float | None) -> str:
    """A share of the logit spread: tiny ones in scientific notation, the rest in percent."""
    if x is None:
        return "-"
    return f"{x:.1e}" if x < 1e-3 else f"{x * 100:.1f} %"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(names: list[str], left: int = 1) -> list[str]:
    """A header and its rule: the first `left` columns left-aligned, the rest right-aligned."""
    return [_row(names), "|" + "|".join("---" if i < left else "---:" for i in range(len(names))) + "|"]


# -- reading a run ---------------------------------------------------------------
def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "trials.jsonl").read_text().splitlines() if line.strip()]


def _arms(rows: list[dict], cfg: dict) -> list[str]:
    """Arms in the order the run named them (config.json), else in the order they ran."""
    seen = list(dict.fromkeys(r["policy"] for r in rows))
    named = [a for a in cfg.get("arms") or [] if a in seen]
    return named + [a for a in seen if a not in named]


def _seeds(rows: list[dict]) -> list[int]:
    return sorted({r["seed"] for r in rows})


def target_ms(cfg: dict) -> float | None:
    """The run's ITL target: a reconstructed config states it; a bench config has it in the controller."""
    if cfg.get("itl_target_ms") is not None:
        return cfg["itl_target_ms"]
    return (cfg.get("controller") or {}).get("target_ms")


# -- kinds -----------------------------------------------------------------------
def laptop(folder: Path, cfg: dict) -> list[str]:
    """`dlfp laptop`'s summary.json: one column per policy."""
    s = json.loads((folder / "summary.json").read_text())
    pol, target = s["policies"], s["itl_target_ms"]
    rows = [
        ("foreground ITL P50 (ms)", lambda p: _n(p["fg_itl_p50_ms"])),
        ("foreground ITL P99 (ms)", lambda p: _n(p["fg_itl_p99_ms"])),
        ("foreground ITL P99 / target", lambda p: _n(p["fg_itl_p99_ms"] / target, 2) if p["fg_itl_p99_ms"] else "-"),
        ("foreground ITL max (ms)", lambda p: _n(p["fg_itl_max_ms"])),
        ("foreground TTFT P99 (ms)", lambda p: _n(p["fg_ttft_p99_ms"])),
        ("foreground TTFT by turn (ms)", lambda p: " / ".join(_n(x, 0) for x in p["fg_ttft_by_turn_ms"])),
        ("background prefill (tokens/s)", lambda p: _n(p["bg_prefill_tokens_per_s"])),
        ("background documents done", lambda p: _n(p["bg_docs_done"])),
        ("requests failed", lambda p: _n(p["requests_failed"])),
        ("foreground prompt tokens reused", lambda p: f"{p['fg_prompt_tokens_reused']:,} of {p['fg_prompt_tokens']:,}"),
        ("guarded steps kept free of background", lambda p: _n(p.get("zero_cap_steps"))),
        ("steps on fewer threads", lambda p: _n(p.get("reduced_thread_steps"))),
        ("wall (s)", lambda p: _n(p["wall_s"])),
    ]
    out = _header(["", *pol])
    out += [_row([label, *[get(p) for p in pol.values()]]) for label, get in rows]
    out += ["", f"ITL target {_n(target, 0)} ms; decode-only ITL (the foreground alone, same run) "
                f"{_n(s['decode_only_itl_ms'])} ms; the same token ids under every policy: "
                f"{_n(s['exact_output_match'])}."]
    return out


def backends_laptop(folder: Path, cfg: dict) -> list[str]:
    """The laptop job once per backend: every `laptop-*.json` (a summary.json) of the folder."""
    out = _header(["backend", "threads", "target (ms)", "decode-only ITL (ms)", "policy", "fg ITL P50 / P99 (ms)",
                   "P99 / target", "fg TTFT P99 (ms)", "bg prefill tok/s", "failed", "same tokens", "wall (s)"], 1)
    for path in sorted(folder.glob("laptop-*.json")):
        s = json.loads(path.read_text())
        desc, target = s["backend"], s["itl_target_ms"]
        for name, p in s["policies"].items():
            out.append(_row([
                backend_label(desc), desc.get("n_threads", "-"), _n(target, 0), _n(s["decode_only_itl_ms"], 0), name,
                f"{_n(p['fg_itl_p50_ms'], 0)} / {_n(p['fg_itl_p99_ms'], 0)}", _n(p["fg_itl_p99_ms"] / target, 2),
                _n(p["fg_ttft_p99_ms"], 0), _n(p["bg_prefill_tokens_per_s"]), _n(p["requests_failed"]),
                _n(s["exact_output_match"]), _n(p["wall_s"], 0)]))
    return out


def backend_label(desc: dict) -> str:
    """A backend's describe() as a short name: runtime, then the build where it has several."""
    name = desc.get("name", "?")
    if name == "executorch":
        return f"ExecuTorch {(desc.get('model') or {}).get('dtype', '')}, {desc.get('layout', '')}".replace(" ,", ",")
    if name == "mlc":
        return f"MLC {desc.get('mode', '')} mode (apache-tvm)"
    return {"llamacpp": "llama.cpp"}.get(name, name)


def check_model(folder: Path, cfg: dict) -> list[str]:
    """`dlfp check-model`: every `check-*.json` of the folder, max (median) share of the logit spread."""
    out = _header(["backend", "vs torch fp32, same weights", "vs llama.cpp, same GGUF", "greedy tokens equal",
                   "passed"], 1)

    def cell(c: dict) -> str:
        verdict = "pass" if c["max_share_of_spread"] <= c["tolerance_share"] else "fails"
        return (f"{_share(c['max_share_of_spread'])} ({_share(c['median_share_of_spread'])}): "
                f"{verdict} at {_share(c['tolerance_share'])}")

    for path in sorted(folder.glob("check-*.json")):
        c = json.loads(path.read_text())
        greedy = "both" if c["vs_torch_fp32"]["greedy_equal"] and c["vs_llamacpp"].get("greedy_equal", True) else "no"
        out.append(_row([backend_label(c["backend"]), cell(c["vs_torch_fp32"]), cell(c["vs_llamacpp"]), greedy,
                         _n(c["passed"])]))
    return out


def et_packed(folder: Path, cfg: dict) -> list[str]:
    """scripts/et_packed_bench.py: the packed and per-sequence ExecuTorch layouts, step by step."""
    out = []
    for path in sorted(folder.glob("et-packed-*.json")):
        r = json.loads(path.read_text())
        out += _header(["step", "per-sequence (s)", "packed (s)", "per-sequence / packed"], 1)
        for plan, t in r["step_time"].items():
            out.append(_row([plan.replace("_", " "), _n(t["median_s"]["per-sequence"], 2),
                             _n(t["median_s"]["packed"], 2), _n(t["per_sequence_over_packed"], 2)]))
        mem = r["memory_4_slots"]
        out += ["", f"Medians of {next(iter(r['step_time'].values()))['n']} alternating steps; threads: "
                    f"{r['threads']}; the packed program with {r['packed_program_slots']} slots. RSS with 4 slots: "
                    f"per-sequence {_n(mem['per-sequence']['rss_mb'], 0)} MB, packed "
                    f"{_n(mem['packed']['rss_mb'], 0)} MB ({_n(mem['per_sequence_over_packed_rss'], 2)}x)."]
    return out


def trials(folder: Path, cfg: dict) -> list[str]:
    """Any bench run: per seed and arm, what a person at the keyboard feels and what the background got."""
    rows = _rows(folder)
    arms = _arms(rows, cfg)
    out = _header(["seed", "arm", "ITL P99 (ms)", "worst ITL (ms)", "TTFT P99 (ms)", "bg prompt tok/s (client)",
                   "completed / submitted"], 2)
    by = {(r["seed"], r["policy"]): r for r in rows}
    for seed in _seeds(rows):
        for arm in arms:
            r = by.get((seed, arm))
            if r is not None:
                out.append(_row([seed, arm, _n(r.get("itl_p99_ms")), _n(r.get("itl_max_ms")), _n(r.get("ttft_p99_ms")),
                                 _n(r.get("bg_prompt_tok_s_client")), f"{r['completed']}/{r['submitted']}"]))
    return out


def sweep(folder: Path, cfg: dict) -> list[str]:
    """A sweep of fixed caps beside dlfp: per trial P99 / worst ITL / bg tok/s, then means and the verdict."""
    rows = _rows(folder)
    target = target_ms(cfg)
    arms = _arms(rows, cfg)
    s = sweep_summary(rows, arms, "bg_prefill_tok_s_fg_active", target)
    if s is None:
        raise ValueError(f"{folder.name}: a sweep needs dlfp and a fixed:N arm (arms: {', '.join(arms)})")
    seeds = _seeds(rows)
    by = {(r["seed"], r["policy"]): r for r in rows}
    out = _header(["arm", *[f"seed {x}" for x in seeds], "P99 mean [95% CI]", "worst P99 / worst ITL",
                   "bg tok/s mean", f"P99 <= {_n(s['bound_ms'], 0)} ms in every trial"], 1)
    for arm, p in s["points"].items():
        cells = []
        for seed in seeds:
            r = by.get((seed, arm))
            cells.append("-" if r is None else " / ".join(
                _n(r.get(k)) for k in ("itl_p99_ms", "itl_max_ms", "bg_prefill_tok_s_fg_active")))
        out.append(_row([arm, *cells, _mean_ci(p["itl_p99_ms"], p["itl_p99_interval"]),
                         f"{_n(p['itl_p99_worst_ms'])} / {_n(p['itl_max_worst_ms'])}", _n(p["x"]),
                         _n(p["meets_every_trial"])]))
    out += ["", "Per seed: P99 ITL / worst ITL (ms) / background prompt tokens/s beside the foreground.",
            "", f"The bench's verdict: {s['verdict']}."]
    return out


def _mean_ci(mean, interval) -> str:
    if mean is None:
        return "-"
    if not interval or interval.get("low") is None:
        return _n(mean)
    return f"{_n(mean)} [{_n(interval['low'])}, {_n(interval['high'])}]"


def phases(folder: Path, cfg: dict) -> list[str]:
    """noisy-neighbour: P99 ITL and bg tok/s before, beside and after the busy process, per trial."""
    rows = _rows(folder)
    arms, target = _arms(rows, cfg), target_ms(cfg)
    bound = target * TARGET_TOLERANCE
    out = _header(["arm", "seed", "P99 ITL before / neighbour / after (ms)", "whole trial P99 (ms)",
                   "bg tok/s before / neighbour / after"], 2)
    by = {(r["seed"], r["policy"]): r for r in rows}
    for arm in arms:
        for seed in _seeds(rows):
            r = by.get((seed, arm))
            if r is None:
                continue
            ph = r["phases"].values()
            out.append(_row([arm, seed, " / ".join(_n(p["itl_p99_ms"]) for p in ph), _n(r["itl_p99_ms"]),
                             " / ".join(_n(p["bg_prefill_tok_s_fg_active"]) for p in ph)]))
    out.append("")
    for arm in arms:
        worst = max(worst_phase_p99(r) for r in rows if r["policy"] == arm)
        out.append(f"- {arm}: worst P99 in any trial and phase {_n(worst)} ms, "
                   f"{'within' if worst <= bound else 'over'} 1.1 T ({_n(bound, 0)} ms).")
    s = sweep_summary(rows, arms, "bg_prefill_tok_s_fg_active", target)
    if s and "verdict" in s:
        out += ["", f"Over whole trials, the bench's verdict: {s['verdict']}."]
    return out


PAIRED_SHOWN = ("itl_p99_ms", "itl_p50_ms", "ttft_p99_ms")


def paired(folder: Path, cfg: dict) -> list[str]:
    """Each arm against the first: the paired change per seed, its mean with a Student-t 95% interval."""
    from dlfp.workloads.specs import get_spec

    rows = _rows(folder)
    arms, seeds = _arms(rows, cfg), _seeds(rows)
    by = {(r["seed"], r["policy"]): r for r in rows}
    gate = get_spec(rows[0]["workload"]).gate
    out = []
    for arm in arms[1:]:
        out += _header([f"{arm} vs {arms[0]}", *[f"seed {s}" for s in seeds], "mean change [95% CI]"], 1)
        for metric in PAIRED_SHOWN:
            changes = paired_changes([by[(s, arms[0])].get(metric) for s in seeds],
                                     [by[(s, arm)].get(metric) for s in seeds])
            iv = t_interval([c for c in changes if c is not None])
            ci = f"{_pct(iv.mean)} [{_pct(iv.low)}, {_pct(iv.high)}]" if iv.low is not None else _pct(iv.mean)
            out.append(_row([metric, *[_pct(c) for c in changes], ci]))
        changes = paired_changes([by[(s, arms[0])].get(gate.metric) for s in seeds],
                                 [by[(s, arm)].get(gate.metric) for s in seeds])
        out += ["", f"Gate ({gate.describe()}): {_gate_verdict(gate, changes)}.", ""]
    return out[:-1]


def _gate_verdict(gate, changes: list[float | None]) -> str:
    """The gate as dlfp.bench.paired judges it, on the figures alone (output agreement is the bench's check)."""
    iv = t_interval([c for c in changes if c is not None])
    if gate.min_reduction is not None:
        ok = all(c is not None and -c >= gate.min_reduction for c in changes)
    else:
        ok = (iv.low if iv.low is not None else iv.mean) <= 0
    return "PASS" if ok else "FAIL"


def multiturn(folder: Path, cfg: dict) -> list[str]:
    """Multi-turn workloads: prompt tokens computed, later turns' TTFT against the first, ITL, background."""
    rows = _rows(folder)
    out = _header(["seed", "arm", "fg prompt tokens computed / total", "TTFT turns 6-8 / turn 1 (medians)",
                   "ITL P99 / worst (ms)", "bg prompt tok/s (client)", "failed"], 2)
    for r in sorted(rows, key=lambda r: (r["seed"], r["policy"])):
        total, computed = r["fg_prompt_tokens"], r["fg_prompt_tokens_computed"]
        saved = f" ({_pct((computed - total) / total)})" if computed != total else ""
        out.append(_row([r["seed"], r["policy"], f"{computed:,} / {total:,}{saved}", _n(r["ttft_turns_6_8_vs_1"], 2),
                         f"{_n(r['itl_p99_ms'])} / {_n(r['itl_max_ms'])}", _n(r["bg_prompt_tok_s_client"]),
                         _n(r["failed"])]))
    return out


def turns(folder: Path, cfg: dict) -> list[str]:
    """Multi-turn workloads, per seed and arm: turn 1's TTFT and turns 2-8's (the median of the
    per-turn medians), against the first arm's in the same seed."""
    rows = [r for r in _rows(folder) if r.get("ttft_by_turn_ms")]
    arms = _arms(rows, cfg)
    later = {(r["seed"], r["policy"]): median(xs) if (xs := [x for x in r["ttft_by_turn_ms"][1:] if x is not None])
             else None for r in rows}
    out = _header(["seed", "arm", "TTFT turn 1 (ms)", "TTFT turns 2-8 (ms)", f"turns 2-8 vs {arms[0]}"], 2)
    for r in sorted(rows, key=lambda r: (r["seed"], arms.index(r["policy"]))):
        mine, ref = later[(r["seed"], r["policy"])], later.get((r["seed"], arms[0]))
        out.append(_row([r["seed"], r["policy"], _n(r["ttft_by_turn_ms"][0], 0), _n(mine, 0),
                         f"{mine / ref:.2f}x" if mine and ref else "-"]))
    return out


def slots(folder: Path, cfg: dict) -> list[str]:
    """Conversations beside documents, per seed against the `unbounded` arm of the same seed:
    prompt tokens reused, later turns' TTFT, requests within the SLO, ITL, background, the
    last document's end, and the slot evictions by reason (in-process runs record them)."""
    rows = _rows(folder)
    base = {r["seed"]: r for r in rows if r["policy"] == "unbounded"}
    out = _header(["seed", "arm", "prompt tokens reused (vs unbounded)", "TTFT turns 6-8 / turn 1",
                   "SLO met", "ITL P99 (ms)", "bg prompt tok/s (client)", "last document done (s, vs unbounded)",
                   "evictions: conversation / background preempted"], 2)
    for r in sorted(rows, key=lambda r: (r["seed"], _arms(rows, cfg).index(r["policy"]))):
        b = base.get(r["seed"])
        reused = r["fg_prompt_tokens_reused"]
        vs = f" ({reused / b['fg_prompt_tokens_reused']:.2f}x)" if b and b["fg_prompt_tokens_reused"] and b is not r else ""
        done = r.get("bg_last_done_s")
        done_vs = f" ({done / b['bg_last_done_s']:.2f}x)" if b and done and b.get("bg_last_done_s") and b is not r else ""
        ev = r.get("slot_evictions")  # an endpoint's server keeps its own, an older build none: not recorded
        evictions = "-" if ev is None or (not ev and not r.get("steps")) else (
            f"{ev.get('conversation_for_foreground', 0) + ev.get('conversation_for_background', 0)} / "
            f"{ev.get('background_preempted', 0)}")
        out.append(_row([r["seed"], r["policy"], f"{reused:,}{vs}", _n(r.get("ttft_turns_6_8_vs_1"), 2),
                         _slo(r),
                         _n(r["itl_p99_ms"]), _n(r["bg_prompt_tok_s_client"]), f"{_n(done)}{done_vs}", evictions]))
    return out


def side_by_side(folder: Path, cfg: dict) -> list[str]:
    """One policy from two builds on the same seeds: `folder` (this build) beside `folder`-base (a
    baseline build's run of the same command), per seed: P99 ITL (worst phase where the workload
    has phases), worst ITL, background prompt tokens per second beside the foreground. Each arm
    is set beside the baseline's arm of its name, else beside the baseline's one arm (a variant
    of this build's policy, `dlfp:turn_first=false`, against the baseline's `dlfp`)."""
    base_folder = folder.parent / (folder.name + "-base")
    rows, base_rows = _rows(folder), _rows(base_folder)
    target = target_ms(cfg)
    base = {(r["seed"], r["policy"]): r for r in base_rows}
    base_arms = {r["policy"] for r in base_rows}
    only = next(iter(base_arms)) if len(base_arms) == 1 else None
    out = _header(["seed", "arm", "P99 ITL (ms) baseline / this", "worst phase P99 (ms) baseline / this",
                   "worst ITL (ms) baseline / this", "bg tok/s baseline / this (ratio)"], 2)
    arms = _arms(rows, cfg)
    per_arm: dict[str, dict[str, list]] = {}
    for r in sorted(rows, key=lambda r: (r["seed"], arms.index(r["policy"]))):
        b = base.get((r["seed"], r["policy"]))
        if b is None and only is not None and r["policy"].startswith(only + ":"):
            b = base.get((r["seed"], only))
        if b is None:
            continue
        x, bx = r["bg_prefill_tok_s_fg_active"], b["bg_prefill_tok_s_fg_active"]
        ratio = x / bx if x is not None and bx else None
        mine = per_arm.setdefault(r["policy"], {"ratios": [], "p99": [], "itl": []})
        mine["ratios"] += [ratio] if ratio is not None else []
        mine["p99"].append(worst_phase_p99(r))
        mine["itl"].append(r["itl_max_ms"])
        out.append(_row([r["seed"], r["policy"], f"{_n(b['itl_p99_ms'])} / {_n(r['itl_p99_ms'])}",
                         f"{_n(worst_phase_p99(b))} / {_n(worst_phase_p99(r))}", f"{_n(b['itl_max_ms'])} / {_n(r['itl_max_ms'])}",
                         f"{_n(bx)} / {_n(x)}" + ("" if ratio is None else f" ({ratio:.2f}x)")]))
    out.append("")
    for arm, m in per_arm.items():
        who = "this build" if len(per_arm) == 1 else f"this build's {arm}"
        if target and m["p99"]:
            out.append(f"- {who}: worst P99 in any trial and phase {_n(max(m['p99']))} ms "
                       f"({'within' if max(m['p99']) <= target * TARGET_TOLERANCE else 'over'} 1.1 T = "
                       f"{_n(target * TARGET_TOLERANCE, 0)} ms); worst ITL {_n(max(m['itl']))} ms "
                       f"({'within' if max(m['itl']) <= 2 * target else 'over'} 2 T).")
        if m["ratios"]:
            out.append(f"- background throughput, {who} / baseline: mean {sum(m['ratios']) / len(m['ratios']):.3f}, "
                       f"lowest {min(m['ratios']):.3f} over {len(m['ratios'])} trials.")
    out.append(f"- the baseline's {source_line(str(base_folder.relative_to(base_folder.parent.parent)), load_config(base_folder))}")
    return out


def _fg_submitted(r: dict) -> int | None:
    """The foreground requests a trial row's goodput counts against: the completed ones and the
    failed (rows that count which goals were missed), else its goals met over its goodput."""
    if "goals_missed" in r and "fg_completed" in r:
        return r["fg_completed"] + r["goals_missed"]["failed"]
    return round(r["goals_met"] / r["goodput"]) if r.get("goodput") else None


def goodput(folder: Path, cfg: dict) -> list[str]:
    """Per seed and arm: requests that met their own goals, beside P99 ITL, TTFT and background
    work (`background_metric`: while a chat streams, or client side where endpoints ran); the
    arms on the goodput frontier; each arm's mean."""
    rows = _rows(folder)
    arms = _arms(rows, cfg)
    x = background_metric(rows)
    g = goodput_summary(rows, arms, x)
    out = _header(["seed", "arm", "goals met", "ITL P99 (ms)", "TTFT P99 (s)",
                   "bg tok/s while a chat streams" if x == FG_ACTIVE_BG else "bg prompt tok/s (client)",
                   "on the goodput frontier"], 2)
    for r in sorted(rows, key=lambda r: (r["seed"], arms.index(r["policy"]))):
        n = _fg_submitted(r)
        met = f"{r['goals_met']} / {n}" if n else str(r.get("goals_met", "-"))
        frontier = r["policy"] in g["trials"][str(r["seed"])]["frontier"] if g else None
        ttft = r.get("ttft_p99_ms")
        out.append(_row([r["seed"], r["policy"], met, _n(r["itl_p99_ms"]), _n(None if ttft is None else ttft / 1e3),
                         _n(r.get(x)), _n(frontier)]))
    if g:
        out.append("")
        for arm, a in g["arms"].items():
            iv = a["interval"]
            ci = f" [{iv['low']:.2f}, {iv['high']:.2f}]" if iv.get("low") is not None else ""
            against = f", on the frontier in {a['on_frontier']}, highest in {a['highest']}" if len(g["arms"]) > 1 else ""
            out.append(f"- {arm}: goodput {a['mean']:.2f}{ci} (mean [95% CI] over {a['trials']} trials)"
                       f"{against}{_missed(a)}.")
        if "verdict" in g:
            out.append(f"- {g['verdict']}.")
    return out


def _missed(arm: dict) -> str:
    """Which goals an arm's requests missed over its trials (where its rows count them)."""
    m = arm.get("missed")
    if m is None:
        return ""
    return f"; goals missed: TTFT {m['ttft']}, ITL {m['itl']}" + (f", failed {m['failed']}" if m["failed"] else "")


def _slo(r: dict) -> str:
    """Foreground requests within the workload's SLO, of those submitted (goodput_fraction's denominator)."""
    frac = r.get("goodput_fraction")
    n = round(r["slo_met"] / frac) if frac else None
    return f"{r['slo_met']} / {n}" if n else str(r["slo_met"])


def soak(folder: Path, cfg: dict) -> list[str]:
    """`dlfp soak`: every result JSON of the folder (a soak or a load test)."""
    out = _header(["run", "requests completed (length / stop)", "client hang-ups", "429s", "5xx / errors",
                   "malformed bodies answered", "RSS growth", "counters reconciled", "drain exit", "pass"], 1)
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        if "requests_completed" not in r:
            continue
        g, fin = r["rss_growth"], r["finish_reasons"]
        out.append(_row([
            f"{r.get('mode', 'soak')}, {_n(r['minutes'], 0)} min, {r['clients']} clients, "
            f"`{' '.join(r['serve_args'])}`",
            f"{r['requests_completed']:,} ({fin.get('length', 0):,} / {fin.get('stop', 0):,})", _n(r["hung_up"]),
            _n(r["rejected_429"]), f"{r['status_5xx']} / {r['errors']}", _n(r["bad_bodies_answered"]),
            f"{_n(g['from_mb'])} MB at {_n(g['from_s'], 0)} s, {_n(g['to_mb'])} MB at {_n(g['to_s'], 0)} s "
            f"({_pct(g['percent'] / 100)})",
            _n(all(c["ok"] for c in r["reconciliation"].values())), r["drain_exit_code"], _n(r["pass"])]))
    return out


def study(folder: Path, cfg: dict) -> list[str]:
    """`dlfp study` (SIMULATED): each design over every condition."""
    from dlfp.study import scoreboard

    return scoreboard(json.loads((folder / "study.json").read_text()))


KINDS: dict[str, Callable[[Path, dict], list[str]]] = {
    "laptop": laptop, "backends-laptop": backends_laptop, "check-model": check_model, "et-packed": et_packed,
    "trials": trials, "sweep": sweep, "phases": phases, "paired": paired, "multiturn": multiturn, "turns": turns,
    "slots": slots,
    "side-by-side": side_by_side, "goodput": goodput,
    "soak": soak,
    "study": study,
}


# -- provenance and markers -----------------------------------------------------
def source_line(rel: str, cfg: dict) -> str:
    """Where a table comes from: the folder, the command, the code and the host, as config.json records them."""
    parts = [f"Source: `{rel}/`"]
    if cfg.get("command"):
        parts.append(f"`{cfg['command']}`")
    elif cfg.get("files"):
        parts.append("one command per file (config.json `files`)")
    commit = (cfg.get("git") or {}).get("commit")
    if commit:
        clean = (cfg.get("git") or {}).get("clean")
        parts.append(f"commit {commit[:10]}" + {True: "", False: " with uncommitted changes", None: ""}[clean])
    if cfg.get("reconstructed"):
        parts.append(f"recorded in commit {cfg['recorded_in_commit'][:10]}; config.json reconstructed "
                     "(code commit, host and model hash not recorded)")
    m = cfg.get("machine")
    if m:
        threads = f", {m['threads_used']} threads used" if m.get("threads_used") else ""
        load = f", 1-min load average {m['load_average'][0]:.1f} when recorded" if m.get("load_average") else ""
        parts.append(f"{m.get('processor') or 'CPU ?'}, {m.get('logical_cores')} logical cores{threads}{load}")
    return " · ".join(parts) + "."


def render(root: Path, rel: str, kind: str) -> str:
    """One block's generated text (between the markers), from `root/rel`."""
    if kind not in KINDS:
        raise ValueError(f"{rel}: unknown table kind {kind!r} (known: {', '.join(KINDS)})")
    folder = Path(root) / rel
    cfg = load_config(folder)
    return "\n".join([*KINDS[kind](folder, cfg), "", source_line(rel, cfg)]) + "\n"


def rewrite_text(text: str, root: Path) -> str:
    """`text` with every block redrawn from its run folder."""
    return MARKER.sub(lambda m: m.group(1) + render(root, m.group(2), m.group(3)) + m.group(5), text)


def blocks(text: str) -> list[tuple[str, str]]:
    """(folder, kind) of every block in `text`."""
    return [(m.group(2), m.group(3)) for m in MARKER.finditer(text)]


def doc_files(root: Path) -> list[Path]:
    root = Path(root)
    return sorted({p for pattern in DOC_FILES for p in root.glob(pattern)})


def rewrite_docs(root: Path, check: bool = False) -> list[Path]:
    """Redraw every block of the README and docs/*.md; returns the files that differed.
    With `check`, nothing is written."""
    stale = []
    for path in doc_files(root):
        text = path.read_text()
        new = rewrite_text(text, root)
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    return stale
