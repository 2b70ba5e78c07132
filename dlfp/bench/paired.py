"""Across trials: paired changes against the baseline, the gate, and the sweep frontier.

The baseline is the first arm (unbounded by default). For each other arm and each
metric, every seed gives one relative change (candidate - baseline) / baseline (for
fractions of requests, `POINTS`, the difference candidate - baseline); their mean gets
a Student-t 95% interval with df = seeds - 1. A trial is valid
only if its outputs agree token for token with the baseline's, every request is
accounted for, and none failed; an invalid trial fails the gate.
"""
from __future__ import annotations

from dlfp.metrics import GOALS, ITL_GOAL_TOLERANCE
from dlfp.stats import paired_changes, paired_differences, t_interval
from dlfp.workloads.specs import Gate

# Lower is better except where listed in HIGHER_IS_BETTER.
PAIRED_METRICS = (
    "itl_p99_ms", "itl_p90_ms", "itl_p50_ms", "ttft_p99_ms", "ttft_p50_ms", "tpot_p99_ms", "e2el_p99_ms",
    "goodput", "goodput_fraction", "prefill_tok_s", "bg_prefill_tok_s", "bg_prefill_tok_s_fg_active",
    "energy_per_output_token_j",
)
HIGHER_IS_BETTER = {"goodput", "goodput_fraction", "prefill_tok_s", "bg_prefill_tok_s", "bg_prefill_tok_s_fg_active"}
# Fractions of requests: their change is a difference (candidate - baseline), shown in points; a
# relative change of a fraction is undefined where the baseline met none and explodes near it.
POINTS = {"goodput", "goodput_fraction"}


def paired_table(rows: list[dict], arms: list[str], seeds: list[int], gate: Gate, agreement: dict) -> dict:
    """`agreement`: seed -> arm -> {"compared", "mismatches"} from output_agreement."""
    by = {(r["seed"], r["policy"]): r for r in rows}
    baseline = arms[0]
    out = {"baseline": baseline, "gate": {"metric": gate.metric, "min_reduction": gate.min_reduction,
                                          "rule": gate.describe()}, "candidates": {}}
    for arm in arms[1:]:
        seeds_here = [s for s in seeds if (s, arm) in by and (s, baseline) in by]
        trials = [_trial(by[(s, baseline)], by[(s, arm)], agreement.get(s, {}).get(arm), gate) for s in seeds_here]
        metrics = {}
        for m in PAIRED_METRICS:
            base = [by[(s, baseline)].get(m) for s in seeds_here]
            cand = [by[(s, arm)].get(m) for s in seeds_here]
            changes = paired_differences(base, cand) if m in POINTS else paired_changes(base, cand)
            known = [c for c in changes if c is not None]
            metrics[m] = {
                "baseline": base,
                "candidate": cand,
                "change": changes,
                "interval": t_interval(known).to_dict() if known else None,
            }
        out["candidates"][arm] = {
            "seeds": seeds_here,
            "trials": trials,
            "metrics": metrics,
            "gate_pass": _gate(trials, metrics.get(gate.metric), gate),
            "exact_output_agreement": all(t["outputs_agree"] for t in trials) if trials else None,
            "reconciled": all(t["reconciled"] for t in trials) if trials else None,
        }
    return out


def _trial(base: dict, cand: dict, agree: dict | None, gate: Gate) -> dict:
    b, c = base.get(gate.metric), cand.get(gate.metric)
    reduction = (b - c) / b if b and c is not None else None
    # Agreement must be shown, not assumed: nothing compared is not a pass.
    outputs_agree = agree is not None and agree["compared"] > 0 and not agree["mismatches"]
    valid = (
        outputs_agree
        and base["reconciled"] and cand["reconciled"]
        and base["failed"] == 0 and cand["failed"] == 0
        and base["fingerprint"] == cand["fingerprint"]
    )
    if gate.min_reduction is None:
        meets = None  # judged on the interval across trials
    else:
        meets = reduction is not None and reduction >= gate.min_reduction
    return {
        "seed": cand["seed"],
        "reduction": reduction,
        "outputs_agree": outputs_agree,
        "requests_compared": agree["compared"] if agree else 0,
        "mismatches": agree["mismatches"][:20] if agree else [],
        "unverifiable": agree.get("unverifiable", 0) if agree else 0,
        "reconciled": base["reconciled"] and cand["reconciled"],
        "failed": base["failed"] + cand["failed"],
        "same_workload": base["fingerprint"] == cand["fingerprint"],
        "valid": valid,
        "pass": valid and (meets is not False),
    }


def _gate(trials: list[dict], metric: dict | None, gate: Gate) -> bool:
    if not trials or not all(t["pass"] for t in trials):
        return False
    if gate.min_reduction is not None:
        return True
    # Do no harm: the change of the metric must not be significantly positive (worse).
    interval = metric["interval"] if metric else None
    if interval is None:
        return False
    if interval["low"] is None:  # one trial: judge the single change
        return interval["mean"] <= 0
    return interval["low"] <= 0


# An arm "meets" the ITL target when its P99 ITL is within this factor of it in every
# trial: the same bound a request's own ITL goal is judged by.
TARGET_TOLERANCE = ITL_GOAL_TOLERANCE


def worst_phase_p99(r: dict) -> float | None:
    """The highest P99 ITL of a trial's phases (a phase without foreground ITLs has none); the trial's without phases."""
    values = [p["itl_p99_ms"] for p in (r.get("phases") or {}).values() if p["itl_p99_ms"] is not None]
    return max(values) if values else r["itl_p99_ms"]


def sweep_summary(rows: list[dict], arms: list[str], x_metric: str, target_ms: float | None,
                  tolerance: float = TARGET_TOLERANCE) -> dict | None:
    """Where DLFP sits among the fixed caps: P99 ITL (lower) vs prefill throughput (higher).

    Per arm: mean P99 ITL and throughput over the trials with their Student-t 95%
    intervals, and whether the arm met the target (P99 <= tolerance x T) in every
    trial. The verdict asks first whether DLFP met the target; only then does the
    throughput ratio to the best fixed cap that also met it decide.
    """
    fixed = [a for a in arms if a.startswith("fixed:")]
    if "dlfp" not in arms or not fixed:
        return None
    bound = target_ms * tolerance if target_ms is not None else None
    shown = fixed + ["dlfp"] + [a for a in arms if a == "unbounded"]
    points = {a: _sweep_point(rows, a, x_metric, bound) for a in shown}
    d = points["dlfp"]
    out = {"x_metric": x_metric, "target_ms": target_ms, "tolerance": tolerance, "bound_ms": bound,
           "points": points}
    if d["itl_p99_ms"] is None or d["x"] is None:
        return out | {"verdict": "DLFP has no P99 ITL or throughput to judge"}
    valid = {a: p for a, p in points.items() if a in fixed and p["itl_p99_ms"] is not None and p["x"] is not None}
    dominated_by = [a for a, p in valid.items() if p["itl_p99_ms"] < d["itl_p99_ms"] and p["x"] > d["x"]]
    meeting = {a: p for a, p in valid.items() if p["meets_every_trial"]}
    best = max(meeting, key=lambda a: meeting[a]["x"]) if meeting else None
    ratio = d["x"] / meeting[best]["x"] if best and meeting[best]["x"] else None
    out |= {
        "dlfp_meets_target": bool(d["meets_every_trial"]),
        "fixed_meeting_target": sorted(meeting, key=lambda a: int(a.split(":")[1])),
        "dlfp_on_frontier": not dominated_by,
        "dominated_by": dominated_by,
        "best_fixed_meeting_target": best,
        "dlfp_throughput_ratio_to_best": ratio,
        "dlfp_meets_95pct": ratio is not None and ratio >= 0.95,
    }
    out["verdict"] = _verdict(out)
    return out


def _verdict(s: dict) -> str:
    bound, best, ratio = s["bound_ms"], s["best_fixed_meeting_target"], s["dlfp_throughput_ratio_to_best"]
    d = s["points"]["dlfp"]
    if bound is None:
        return "no ITL target: nothing to judge against"
    if not s["dlfp_meets_target"]:
        line = (f"FAIL: DLFP missed the target (P99 ITL {_ms(d['itl_p99_worst_ms'])} ms in its worst trial "
                f"> {_ms(bound)} ms)")
        if s["fixed_meeting_target"]:
            line += f"; {', '.join(s['fixed_meeting_target'])} met it in every trial and DLFP did not"
        return line
    dominated = s["dominated_by"]
    if best is None:
        line = "PASS: DLFP met the target in every trial; no fixed cap did"
    else:
        ok = ratio is not None and ratio >= 0.95
        line = (f"{'PASS' if ok and not dominated else 'FAIL'}: DLFP met the target in every trial; "
                f"its background throughput is {ratio:.3f} x that of {best}, the best fixed cap that also met it "
                f"({'>=' if ok else '<'} 0.95)")
    if dominated:
        line += f"; dominated by {', '.join(dominated)} (lower mean P99 and higher throughput)"
    return line


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _sweep_point(rows: list[dict], arm: str, x_metric: str, bound: float | None) -> dict:
    mine = [r for r in rows if r["policy"] == arm]
    p99 = [r["itl_p99_ms"] for r in mine if r.get("itl_p99_ms") is not None]
    xs = [r[x_metric] for r in mine if r.get(x_metric) is not None]
    worst = [r["itl_max_ms"] for r in mine if r.get("itl_max_ms") is not None]

    def interval(values: list[float]) -> dict | None:
        return t_interval(values).to_dict() if values else None

    return {
        "trials": len(mine),
        "itl_p99_ms": sum(p99) / len(p99) if p99 else None,
        "itl_p99_interval": interval(p99),
        "itl_p99_worst_ms": max(p99) if p99 else None,
        "itl_max_worst_ms": max(worst) if worst else None,
        "x": sum(xs) / len(xs) if xs else None,
        "x_interval": interval(xs),
        # every trial, and each with a P99: a trial that produced none did not meet it
        "meets_every_trial": bool(mine) and bound is not None and len(p99) == len(mine)
        and all(v <= bound for v in p99),
    }


FG_ACTIVE_BG, CLIENT_BG = "bg_prefill_tok_s_fg_active", "bg_prompt_tok_s_client"


def background_metric(rows: list[dict]) -> str:
    """The background throughput the goodput frontier weighs: prompt tokens loaded while a
    foreground request is in flight where every arm reports it (in-process runs: the work a
    cap trades for the chats' goals), else completed background prompts per second as the
    client sees them (endpoints report only that). The client's rate alone ties every arm
    whose documents all finish within the trial."""
    return FG_ACTIVE_BG if rows and all(r.get(FG_ACTIVE_BG) is not None for r in rows) else CLIENT_BG


def goodput_summary(rows: list[dict], arms: list[str], x_metric: str) -> dict | None:
    """Goodput (foreground requests that met their own goals) per arm and trial, beside
    background throughput; the goodput frontier per trial: the arms no other arm beats on
    both goodput and background throughput in that trial."""
    by = {(r["seed"], r["policy"]): r for r in rows if r.get("goodput") is not None}
    seeds = sorted({seed for seed, _ in by})
    if not seeds:
        return None
    trials = {}
    for seed in seeds:
        here = {a: by[(seed, a)] for a in arms if (seed, a) in by}
        points = {a: (r["goodput"], r.get(x_metric)) for a, r in here.items()}
        frontier = [a for a, (g, x) in points.items()
                    if not any(g2 > g and x is not None and x2 is not None and x2 > x
                               for b, (g2, x2) in points.items() if b != a)]
        best = max(g for g, _ in points.values())
        trials[str(seed)] = {"goodput": {a: g for a, (g, _) in points.items()}, "frontier": frontier,
                             "highest": [a for a, (g, _) in points.items() if g == best]}
    per_arm = {}
    for a in arms:
        values = [by[(s, a)]["goodput"] for s in seeds if (s, a) in by]
        if values:
            per_arm[a] = {"mean": sum(values) / len(values), "interval": t_interval(values).to_dict(),
                          "on_frontier": sum(a in t["frontier"] for t in trials.values()),
                          "highest": sum(a in t["highest"] for t in trials.values()), "trials": len(values)}
            missed = [by[(s, a)].get("goals_missed") for s in seeds if (s, a) in by]
            if all(missed):  # which goal the misses were, over the trials (rows that count them)
                per_arm[a]["missed"] = {g: sum(m.get(g, 0) for m in missed) for g in GOALS}
    out = {"x_metric": x_metric, "trials": trials, "arms": per_arm}
    if "dlfp" in per_arm and len(per_arm) > 1:  # alone, no arm to be on a frontier against
        d, n = per_arm["dlfp"], per_arm["dlfp"]["trials"]
        out["verdict"] = (f"dlfp on the goodput frontier in {d['on_frontier']} of {n} trials; "
                          f"goodput at least every other arm's in {d['highest']} of {n}")
    return out
