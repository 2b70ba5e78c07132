"""Across trials: paired changes against the baseline, the gate, and the sweep frontier.

The baseline is the first arm (unbounded by default). For each other arm and each
metric, every seed gives one relative change (candidate - baseline) / baseline;
their mean gets a Student-t 95% interval with df = seeds - 1. A trial is valid
only if its outputs agree token for token with the baseline's, every request is
accounted for, and none failed; an invalid trial fails the gate.
"""
from __future__ import annotations

from dlfp.stats import paired_changes, t_interval
from dlfp.workloads.specs import Gate

# Lower is better except where listed in HIGHER_IS_BETTER.
PAIRED_METRICS = (
    "itl_p99_ms", "itl_p90_ms", "itl_p50_ms", "ttft_p99_ms", "ttft_p50_ms", "tpot_p99_ms", "e2el_p99_ms",
    "goodput_fraction", "prefill_tok_s", "bg_prefill_tok_s", "bg_prefill_tok_s_fg_active",
    "energy_per_output_token_j",
)
HIGHER_IS_BETTER = {"goodput_fraction", "prefill_tok_s", "bg_prefill_tok_s", "bg_prefill_tok_s_fg_active"}


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
            changes = paired_changes(base, cand)
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


def sweep_summary(rows: list[dict], arms: list[str], x_metric: str, target_ms: float | None) -> dict | None:
    """Where DLFP sits among the fixed caps: P99 ITL (lower) vs prefill throughput (higher)."""
    fixed = [a for a in arms if a.startswith("fixed:")]
    if "dlfp" not in arms or not fixed:
        return None
    points = {a: _mean_point(rows, a, x_metric) for a in fixed + ["dlfp"] + [a for a in arms if a == "unbounded"]}
    d = points["dlfp"]
    if d["itl_p99_ms"] is None or d["x"] is None:
        return {"x_metric": x_metric, "points": points, "target_ms": target_ms}
    valid = {a: p for a, p in points.items() if a in fixed and p["itl_p99_ms"] is not None and p["x"] is not None}
    dominated_by = [a for a, p in valid.items() if p["itl_p99_ms"] < d["itl_p99_ms"] and p["x"] > d["x"]]
    meeting = {a: p for a, p in valid.items() if target_ms is not None and p["itl_p99_ms"] <= target_ms}
    best = max(meeting, key=lambda a: meeting[a]["x"]) if meeting else None
    ratio = d["x"] / meeting[best]["x"] if best and meeting[best]["x"] else None
    return {
        "x_metric": x_metric,
        "target_ms": target_ms,
        "points": points,
        "dlfp_on_frontier": not dominated_by,
        "dominated_by": dominated_by,
        "best_fixed_meeting_target": best,
        "dlfp_throughput_ratio_to_best": ratio,
        "dlfp_meets_95pct": ratio is not None and ratio >= 0.95,
    }


def _mean_point(rows: list[dict], arm: str, x_metric: str) -> dict:
    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if r["policy"] == arm and r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {"itl_p99_ms": mean("itl_p99_ms"), "x": mean(x_metric)}
