"""From traces to the rows of trials.jsonl: metrics, accounting, agreement.

Metric columns describe the foreground class (the one the cap protects); for
workloads with background work, `bg_*` columns describe it. Beside the ITL
percentiles, what a person at the keyboard feels: the worst foreground stall
(`itl_max_ms`) and the seconds spent in stalls over 1 s (`stall_s_over_1s`): one
long freeze among hundreds of fast tokens barely moves a per-token percentile.
`bg_prompt_tok_s_client` (prompt tokens of completed background requests over the
run window) is measured the same way for every arm, endpoints included. Multi-turn
workloads add the median TTFT per turn and the foreground prompt tokens reused. Every measured
request must be accounted for: submitted = completed + failed, where completed
means it produced exactly `max_tokens` tokens (EOS is ignored), and failed
covers errors, aborts, short outputs and refusals at submit.
"""
from __future__ import annotations

import numpy as np

from dlfp.bench.runner import TrialRun
from dlfp.metrics import GOALS, itls, missed_goals, percentile, request_metrics, ttft
from dlfp.sequence import BACKGROUND, FOREGROUND
from dlfp.trace import RequestRecord, StepRecord, control_counts, rule_counts
from dlfp.workloads.schedule import Schedule
from dlfp.workloads.specs import WorkloadSpec


def trial_row(run: TrialRun, schedule: Schedule, spec: WorkloadSpec, itl_target_ms: float | None = None) -> dict:
    """`itl_target_ms`: the run's ITL target, a foreground request's goal where it names none."""
    planned = {p.request_id: p for p in schedule.measured}
    records = _latest_by_id(r for r in run.trace.requests if r.request_id in planned)
    completed = [r for r in records.values() if _complete(r, planned[r.request_id].max_tokens)]
    done_ids = {r.request_id for r in completed}
    failed_ids = {rid for rid in records if rid not in done_ids} | (set(run.refused) - done_ids)
    lost = set(planned) - done_ids - failed_ids
    fg = [r for r in records.values() if r.priority == FOREGROUND]
    bg = [r for r in records.values() if r.priority == BACKGROUND]
    start = min((p.arrival_s for p in records.values()), default=0.0)
    end = max((r.finished_s or r.arrival_s for r in records.values()), default=start)
    steps = [s for s in run.trace.steps if start <= s.t1 <= end]
    row = {
        "seed": run.seed,
        "policy": run.arm,
        "order": run.order,
        "workload": spec.name,
        "fingerprint": schedule.fingerprint,
        "submitted": len(planned),
        "completed": len(completed),
        "failed": len(failed_ids),
        "lost": len(lost),
        "reconciled": not lost and len(completed) + len(failed_ids) == len(planned),
        "output_tokens": sum(len(r.output_ids) for r in completed),
        "expected_output_tokens": sum(planned[r.request_id].max_tokens for r in completed),
        "errors": sorted({r.error for r in records.values() if r.error} | set(run.refused.values()))[:10],
    }
    fg_metrics = request_metrics([r for r in fg if r.request_id in done_ids], spec.slo)
    for key in ("requests", "failed"):  # the accounting above covers every class
        fg_metrics.pop(key)
    for key in ("completed", "prompt_tokens", "output_tokens"):
        fg_metrics[f"fg_{key}"] = fg_metrics.pop(key)
    row.update(fg_metrics)
    n_fg = sum(1 for p in planned.values() if p.priority == FOREGROUND)
    # Goodput counts against every submitted foreground request: a failed one met no SLO.
    row["goodput_fraction"] = row["slo_met"] / n_fg if n_fg else None
    # Goodput: foreground requests that met their own goals (a request's, else the run's target
    # and the workload's TTFT SLO), against every submitted one.
    missed = {r.request_id: _own_goals_missed(r, spec, itl_target_ms) if r.request_id in done_ids else ["failed"]
              for r in fg}
    row["goals_met"] = sum(1 for m in missed.values() if not m)
    row["goodput"] = row["goals_met"] / n_fg if n_fg else None
    # Which goal each miss was (a request may miss both TTFT and ITL).
    row["goals_missed"] = {g: sum(g in m for m in missed.values()) for g in GOALS}
    row["goals_missed"]["failed"] += n_fg - len(missed)  # submitted and never recorded: failed
    row["bg_completed"] = sum(1 for r in bg if r.request_id in done_ids)
    fg_done = [r for r in fg if r.request_id in done_ids]
    row.update(_stalls(fg_done))
    window = end - start
    bg_prompt = sum(r.prompt_len for r in bg if r.request_id in done_ids)
    row["bg_prompt_tok_s_client"] = bg_prompt / window if bg and window > 0 else None
    row["fg_prompt_tokens_reused"] = sum(r.cached_prompt_tokens for r in fg_done)
    row["fg_prompt_tokens_computed"] = row["fg_prompt_tokens"] - row["fg_prompt_tokens_reused"]
    row["slot_evictions"] = dict(run.trace.slot_evictions)
    row["bg_preemptions"] = sum(r.preemptions for r in bg)
    bg_ends = [r.finished_s for r in bg if r.request_id in done_ids and r.finished_s is not None]
    row["bg_last_done_s"] = max(bg_ends) - run.trace.origin if bg_ends else None
    row.update(_by_turn(fg_done, planned))
    if not run.trace.steps:  # a target that cannot see its steps (an endpoint) has no step figures
        steps = None
    row["prefill_tok_s"] = _rate(steps, ("n_prefill_fg", "n_prefill_bg"), [(start, end)])
    row["bg_prefill_tok_s"] = _rate(steps, ("n_prefill_bg",), [(start, end)]) if bg else None
    fg_windows = _fg_windows(fg)
    row["bg_prefill_tok_s_fg_active"] = _rate(steps, ("n_prefill_bg",), fg_windows) if bg else None
    row["bg_prefill_tok_s_fg_share"] = share_rate(steps, fg_windows) if bg else None
    row.update(_step_stats(steps, run.trace.max_threads))
    if run.neighbour is not None:
        row["neighbour_s"] = [t - run.trace.origin for t in run.neighbour]
        row["phases"] = _phases(fg_done, fg, steps, (start, *run.neighbour, end), bool(bg))
    row.update(_energy(run, start, end, list(records.values())))
    row["window_s"] = end - start
    row["goodput_req_s"] = row["slo_met"] / row["window_s"] if row.get("slo_met") is not None and end > start else None
    row["trial_wall_s"] = run.wall_s
    row["max_submit_lag_s"] = run.max_submit_lag_s
    row["notes"] = list(run.trace.notes)
    return row


STALL_S = 1.0  # a gap between tokens a person notices as the text freezing


def _stalls(fg: list[RequestRecord]) -> dict:
    gaps = [g for r in fg for g in itls(r)]
    return {"itl_max_ms": max(gaps) * 1e3 if gaps else None,
            "stall_s_over_1s": sum(g for g in gaps if g > STALL_S) if gaps else None}


def _own_goals_missed(r: RequestRecord, spec: WorkloadSpec, itl_target_ms: float | None) -> list[str]:
    """Judged by the goals the request carried (its trace record), else the run's."""
    ttft_s = r.ttft_goal_s if r.ttft_goal_s is not None else spec.slo.ttft_s
    target_s = r.itl_target_s if r.itl_target_s is not None else (None if itl_target_ms is None else itl_target_ms / 1e3)
    return missed_goals(r, ttft_s, target_s)


def _by_turn(fg: list[RequestRecord], planned: dict) -> dict:
    """Median TTFT per session turn, and turns 6-8 against turn 1 (multi-turn workloads)."""
    by: dict[int, list[float]] = {}
    for r in fg:
        p = planned[r.request_id]
        if p.session and r.token_times:
            by.setdefault(p.turn, []).append(ttft(r))
    if not by:
        return {}
    med = [float(np.median(by[k])) * 1e3 if k in by else None for k in range(max(by) + 1)]
    late = [t for k in (5, 6, 7) if k in by for t in by[k]]
    first = med[0]
    ratio = float(np.median(late)) * 1e3 / first if late and first else None
    return {"ttft_by_turn_ms": med, "ttft_turns_6_8_vs_1": ratio}


def _latest_by_id(records) -> dict[str, RequestRecord]:
    out: dict[str, RequestRecord] = {}
    for r in records:
        out[r.request_id] = r
    return out


def _complete(r: RequestRecord, max_tokens: int) -> bool:
    return r.ok and r.finish_reason == "length" and len(r.output_ids) == max_tokens == len(r.token_times)


def _fg_windows(fg: list[RequestRecord]) -> list[tuple[float, float]]:
    """Union of [arrival, finish] of foreground requests: when the foreground was active."""
    spans = sorted((r.arrival_s, r.finished_s) for r in fg if r.finished_s is not None)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _rate(steps: list[StepRecord] | None, keys: tuple[str, ...], windows: list[tuple[float, float]]) -> float | None:
    """Prompt tokens per second over the windows (a step counts where it completed)."""
    length = sum(b - a for a, b in windows)
    if steps is None or length <= 0:
        return None
    tokens = sum(sum(getattr(s, k) for k in keys) for s in steps if any(a <= s.t1 <= b for a, b in windows))
    return tokens / length


def share_rate(steps: list[StepRecord] | None, windows: list[tuple[float, float]]) -> float | None:
    """Background prompt tokens per second over the windows, each step's tokens counted by
    the share of its time inside them. `_rate` counts a step where it completed, so a long
    step that was in flight when a chat arrived counts whole toward the chat's window; an
    engine that cuts that step at the arrival (to start the chat at once) loses it there."""
    length = sum(b - a for a, b in windows)
    if steps is None or length <= 0:
        return None
    tokens = 0.0
    for s in steps:
        if s.n_prefill_bg:
            inside = sum(max(0.0, min(b, s.t1) - max(a, s.t0)) for a, b in windows)
            span = s.t1 - s.t0
            tokens += s.n_prefill_bg * (inside / span if span > 0 else float(any(a <= s.t1 <= b for a, b in windows)))
    return tokens / length


PHASES = ("before", "neighbour", "after")


def _phases(done_fg: list[RequestRecord], fg: list[RequestRecord], steps: list[StepRecord] | None,
            edges: tuple[float, float, float, float], has_bg: bool) -> dict:
    """Per phase (before / while / after the neighbour ran): P99 and max ITL, bg tok/s beside fg."""
    out = {}
    windows = _fg_windows(fg)
    for name, lo, hi in zip(PHASES, edges, edges[1:]):
        gaps = [b - a for r in done_fg for a, b in zip(r.token_times, r.token_times[1:]) if lo <= b < hi]
        clipped = [(max(a, lo), min(b, hi)) for a, b in windows if b > lo and a < hi]
        p99 = percentile(gaps, 99)
        out[name] = {
            "itl_p99_ms": p99 * 1e3 if p99 is not None else None,
            "itl_max_ms": max(gaps) * 1e3 if gaps else None,
            "bg_prefill_tok_s_fg_active": _rate(steps, ("n_prefill_bg",), clipped) if has_bg else None,
        }
    return out


STEP_GAP_MAX_S = 0.05  # longer than this between steps, the engine was idle, not busy between them


def _step_stats(steps: list[StepRecord] | None, max_threads: int | None) -> dict:
    steps = steps or []
    capped = [s for s in steps if s.capped]
    # The engine's own time between one step's end and the next one's start (collecting,
    # sampling, planning): time no step runs while a chat waits on every one.
    ordered = sorted(steps, key=lambda s: s.t0)
    gaps = [b.t0 - a.t1 for a, b in zip(ordered, ordered[1:]) if 0 <= b.t0 - a.t1 < STEP_GAP_MAX_S]
    return {
        "step_gap_ms_mean": float(np.mean(gaps)) * 1e3 if gaps else None,
        "steps": len(steps),
        "capped_steps": len(capped),
        **control_counts(steps, max_threads),
        "decision_rules": rule_counts(steps),
        "capped_step_max_ms": max(s.duration_s for s in capped) * 1e3 if capped else None,
        "step_max_ms": max(s.duration_s for s in steps) * 1e3 if steps else None,
    }


def _energy(run: TrialRun, start: float, end: float, records: list[RequestRecord]) -> dict:
    """Energy per output token where probes left readings in the trace; None otherwise."""
    out = {"energy_j": None, "energy_per_output_token_j": None, "energy_source": None}
    if not run.trace.samples:
        return out
    try:
        from dlfp.devices.energy import energy_report
    except ImportError:
        return out
    rep = energy_report(run.trace.samples, start, end, run.trace.steps, records)
    out.update(energy_j=rep.get("energy_j"), energy_per_output_token_j=rep.get("j_per_output_token"),
               energy_source=rep.get("energy_source"), peak_temp_c=rep.get("peak_temp_c"))
    return out


def output_agreement(runs: list[TrialRun], baseline: str) -> dict[str, dict]:
    """Token ids of every request completed under both the baseline and each arm, compared.

    Returns arm -> {"compared", "mismatches": [request ids], "unverifiable"}; a request
    whose token ids a target could not report (negative ids) is unverifiable, not a match.
    """
    by_arm = {r.arm: {rec.request_id: rec for rec in r.trace.requests if rec.ok} for r in runs}
    base = by_arm.get(baseline, {})
    out = {}
    for arm, recs in by_arm.items():
        if arm == baseline:
            continue
        common = sorted(set(base) & set(recs))
        known = [rid for rid in common if min(base[rid].output_ids + recs[rid].output_ids, default=0) >= 0]
        bad = [rid for rid in known if base[rid].output_ids != recs[rid].output_ids]
        out[arm] = {"compared": len(known), "mismatches": bad, "unverifiable": len(common) - len(known)}
    return out
