"""Request latency metrics, with the definitions of `vllm bench serve`.

TTFT = first token - arrival; ITL = every gap between consecutive tokens of a
request; TPOT = (E2EL - TTFT) / (n_out - 1); E2EL = last token - arrival.
Percentiles use numpy's linear interpolation, as vLLM's benchmark does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlfp.trace import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    mean_itl_s: float | None = None
    e2el_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or not r.token_times:
            return False
        if self.ttft_s is not None and ttft(r) > self.ttft_s:
            return False
        gaps = itls(r)
        if self.mean_itl_s is not None and gaps and float(np.mean(gaps)) > self.mean_itl_s:
            return False
        return self.e2el_s is None or e2el(r) <= self.e2el_s


# A request meets its ITL goal when its own P99 ITL is within this factor of its target; the
# bench holds a whole arm's P99 to the same bound (dlfp.bench.paired.TARGET_TOLERANCE).
ITL_GOAL_TOLERANCE = 1.1
ITL_GOAL_PERCENTILE = 99  # of the request's own ITLs, linearly interpolated (`percentile`)


GOALS = ("ttft", "itl", "failed")  # what a request's miss can be (`missed_goals`)


def missed_goals(r: RequestRecord, ttft_goal_s: float | None, itl_target_s: float | None) -> list[str]:
    """The goals the request missed, from `GOALS`: "failed" (no tokens, or an error), "ttft" (its
    first token later than `ttft_goal_s`), "itl" (the P99 of its own ITLs over 1.1 x
    `itl_target_s`); a goal of None is not judged. Empty: it met them all."""
    if not r.ok or not r.token_times:
        return ["failed"]
    missed = []
    if ttft_goal_s is not None and ttft(r) > ttft_goal_s:
        missed.append("ttft")
    p99 = percentile(itls(r), ITL_GOAL_PERCENTILE)
    if itl_target_s is not None and p99 is not None and p99 > ITL_GOAL_TOLERANCE * itl_target_s:
        missed.append("itl")
    return missed


def goals_met(r: RequestRecord, ttft_goal_s: float | None, itl_target_s: float | None) -> bool:
    """The request's own goals: it completed, its TTFT is within `ttft_goal_s`, and the P99 of
    its own ITLs is within 1.1 x `itl_target_s` (a goal of None is not judged)."""
    return not missed_goals(r, ttft_goal_s, itl_target_s)


def ttft(r: RequestRecord) -> float:
    return r.token_times[0] - r.arrival_s


def e2el(r: RequestRecord) -> float:
    return r.token_times[-1] - r.arrival_s


def itls(r: RequestRecord) -> list[float]:
    t = r.token_times
    return [b - a for a, b in zip(t, t[1:])]


def tpot(r: RequestRecord) -> float | None:
    n = len(r.token_times)
    return (e2el(r) - ttft(r)) / (n - 1) if n > 1 else None


def percentile(values, q: float) -> float | None:
    """Linear-interpolated percentile; None for an empty sample (never a made-up 0)."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def weighted_quantile(values: list[float], weights: list[int], q: float) -> float:
    """The smallest value whose weight, with every smaller one's, reaches q of the total: numpy's
    weighted `quantile(method="inverted_cdf")` without its per-call cost (asked every step)."""
    total, cum = float(sum(weights)), 0.0
    ordered = sorted(zip(values, weights), key=lambda vw: vw[0])
    for value, weight in ordered:
        cum += weight
        if cum and cum / total >= q:
            return value
    return ordered[-1][0]


def summarize(values, prefix: str, scale: float = 1e3) -> dict:
    """mean and P50/P90/P99 of `values` (seconds) in milliseconds under `prefix`."""
    out = {f"{prefix}_mean_ms": float(np.mean(values)) * scale if len(values) else None}
    for q in PERCENTILES:
        p = percentile(values, q)
        out[f"{prefix}_p{q}_ms"] = p * scale if p is not None else None
    return out


def request_metrics(records: list[RequestRecord], slo: SLO | None = None) -> dict:
    """TTFT, ITL, TPOT, E2EL summaries, counts and SLO goodput for a set of requests."""
    done = [r for r in records if r.ok and r.token_times]
    out: dict = {
        "requests": len(records),
        "completed": len(done),
        "failed": sum(1 for r in records if not r.ok),
        "prompt_tokens": sum(r.prompt_len for r in done),
        "output_tokens": sum(len(r.output_ids) for r in done),
    }
    out.update(summarize([ttft(r) for r in done], "ttft"))
    out.update(summarize([g for r in done for g in itls(r)], "itl"))
    out.update(summarize([x for r in done if (x := tpot(r)) is not None], "tpot"))
    out.update(summarize([e2el(r) for r in done], "e2el"))
    if slo is not None:
        out["slo_met"] = sum(1 for r in done if slo.met(r))
        out["goodput_fraction"] = out["slo_met"] / len(records) if records else None
    return out

