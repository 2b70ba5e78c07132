"""Energy and peak temperature from probe samples: pure functions, no I/O.

`energy_report(samples, t0, t1, steps, requests)` turns the samples a
`ProbeSampler` put in a trace into energy over [t0, t1]:

- counters first: RAPL `energy_uj` (unwrapped at `max_energy_range_uj`; package
  domains, since sub-domains are parts of them) and NVML `energy_mj` (per GPU);
  both present: CPU package + GPUs;
- battery discharge power, integrated (trapezoid), only when there is no counter;
- between two samples power is taken as constant, so the energy of any interval
  (a step, the window's edges) is interpolated linearly in time.

With steps and requests, energy is split by time: a step in which only one class
ran (its prefill, or tokens it emitted at the step's end) is charged to that
class; steps mixing classes go to "mixed", and time between steps is "idle".
Per class: energy, output tokens, joules per output token, and per prompt token.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from dlfp.sequence import BACKGROUND, FOREGROUND

TEMP_PROBES = ("thermal", "hwmon", "nvml")


@dataclass
class Series:
    """Cumulative energy (J) of one source at its sample times."""

    kind: str
    t: list[float]
    joules: list[float]

    def at(self, t: float) -> float:
        """Cumulative energy at t, linear between samples, flat outside them."""
        if t <= self.t[0]:
            return self.joules[0]
        if t >= self.t[-1]:
            return self.joules[-1]
        i = bisect.bisect_right(self.t, t)
        t_a, t_b = self.t[i - 1], self.t[i]
        j_a, j_b = self.joules[i - 1], self.joules[i]
        return j_a + (j_b - j_a) * (t - t_a) / (t_b - t_a)

    def between(self, t0: float, t1: float) -> float:
        return self.at(t1) - self.at(t0)

    def covered(self, t0: float, t1: float) -> float:
        return max(0.0, min(t1, self.t[-1]) - max(t0, self.t[0]))


def unwrap(counts: list[int], max_range: int) -> list[int]:
    """A wrapping counter made monotonic: a drop means it passed max_range and restarted at 0."""
    out = [0]
    for prev, cur in zip(counts, counts[1:]):
        out.append(out[-1] + (cur - prev if cur >= prev else cur + max_range - prev))
    return out


def energy_series(samples: list[dict]) -> dict[str, Series]:
    """One cumulative-energy series per source that can give one."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for s in samples:
        if "unavailable" in s:
            continue
        if s["probe"] == "rapl" and "energy_uj" in s and s.get("top_level") and _is_package(s):
            rows[f"rapl:{s['source']}"].append(s)
        elif s["probe"] == "nvml" and "energy_mj" in s:
            rows[f"nvml:{s['source']}"].append(s)
        elif s["probe"] == "battery" and "discharge_w" in s:
            rows[f"battery:{s['source']}"].append(s)
    out = {}
    for key, rs in rows.items():
        rs.sort(key=lambda s: s["t"])
        if len(rs) < 2:
            continue
        out[key] = _series(key.split(":")[0], rs)
    return out


def _series(kind: str, rs: list[dict]) -> Series:
    t = [s["t"] for s in rs]
    if kind == "rapl":
        uj = unwrap([s["energy_uj"] for s in rs], rs[-1].get("max_energy_range_uj") or 2**32)
        return Series(kind, t, [u / 1e6 for u in uj])
    if kind == "nvml":
        return Series(kind, t, [(s["energy_mj"] - rs[0]["energy_mj"]) / 1e3 for s in rs])
    joules = [0.0]  # battery: trapezoid over discharge power
    for a, b in zip(rs, rs[1:]):
        joules.append(joules[-1] + (a["discharge_w"] + b["discharge_w"]) / 2 * (b["t"] - a["t"]))
    return Series(kind, t, joules)


def _is_package(s: dict) -> bool:
    # psys (the whole platform) would double-count the package; dram/core are sub-domains.
    return not str(s.get("domain", "package")).startswith("psys")


def chosen(series: dict[str, Series]) -> tuple[str | None, dict[str, Series]]:
    """Counters when there are any (RAPL + NVML), else battery discharge."""
    counters = {k: s for k, s in series.items() if s.kind in ("rapl", "nvml")}
    if counters:
        kinds = sorted({s.kind for s in counters.values()}, key=("rapl", "nvml").index)
        return "+".join(kinds), counters
    battery = {k: s for k, s in series.items() if s.kind == "battery"}
    return ("battery", battery) if battery else (None, {})


def peak_temperature(samples: list[dict], t0: float, t1: float) -> tuple[float | None, str | None]:
    best, where = None, None
    for s in samples:
        if s["probe"] in TEMP_PROBES and "temp_c" in s and t0 <= s["t"] <= t1:
            if best is None or s["temp_c"] > best:
                best, where = s["temp_c"], f"{s['probe']}:{s['source']}"
    return best, where


def energy_report(samples: list[dict], t0: float, t1: float, steps=None, requests=None) -> dict:
    """Energy over [t0, t1] (see the module docstring); steps/requests add the per-class split."""
    series = energy_series(samples)
    kind, used = chosen(series)
    peak, peak_at = peak_temperature(samples, t0, t1)
    report: dict = {
        "window_s": t1 - t0,
        "energy_source": kind,
        "sources": {k: {"kind": s.kind, "energy_j": s.between(t0, t1), "covered_s": s.covered(t0, t1)}
                    for k, s in series.items()},
        "energy_j": sum(s.between(t0, t1) for s in used.values()) if used else None,
        "peak_temp_c": peak,
        "peak_temp_source": peak_at,
    }
    if not used:
        report["unavailable"] = _why_no_energy(samples)
    if requests is not None:
        n_out = sum(1 for r in requests for t in r.token_times if t0 <= t <= t1)
        report["output_tokens"] = n_out
        report["j_per_output_token"] = _per(report["energy_j"], n_out)
    if steps is not None and requests is not None and used:
        report["per_class"] = split_by_class(used, t0, t1, steps, requests)
    return report


def split_by_class(used: dict[str, Series], t0: float, t1: float, steps, requests) -> dict:
    def energy(a: float, b: float) -> float:
        return sum(s.between(a, b) for s in used.values())

    tokens_at: dict[float, list[str]] = defaultdict(list)
    for r in requests:
        for t in r.token_times:
            tokens_at[t].append(r.priority)
    buckets = {k: {"steps": 0, "time_s": 0.0, "energy_j": 0.0, "output_tokens": 0, "prompt_tokens": 0}
               for k in (FOREGROUND, BACKGROUND, "mixed")}
    busy = 0.0
    for st in steps:
        if st.t0 < t0 or st.t1 > t1:
            continue
        emitted = tokens_at.get(st.t1, [])
        active = set(emitted)
        if st.n_prefill_fg:
            active.add(FOREGROUND)
        if st.n_prefill_bg:
            active.add(BACKGROUND)
        b = buckets[active.pop() if len(active) == 1 else "mixed"]
        b["steps"] += 1
        b["time_s"] += st.t1 - st.t0
        b["energy_j"] += energy(st.t0, st.t1)
        b["output_tokens"] += len(emitted)
        b["prompt_tokens"] += st.n_prefill_fg + st.n_prefill_bg
        busy += st.t1 - st.t0
    for b in buckets.values():
        b["j_per_output_token"] = _per(b["energy_j"], b["output_tokens"])
        b["j_per_prompt_token"] = _per(b["energy_j"], b["prompt_tokens"])
    total = energy(t0, t1)
    buckets["idle"] = {"time_s": (t1 - t0) - busy, "energy_j": total - sum(b["energy_j"] for b in buckets.values())}
    return buckets


def _per(energy_j: float | None, n: int) -> float | None:
    return energy_j / n if energy_j is not None and n > 0 else None


def _why_no_energy(samples: list[dict]) -> str:
    reasons = set()
    for s in samples:
        if s["probe"] not in ("rapl", "nvml", "battery"):
            continue
        why = s.get("unavailable") or s.get("missing", {}).get("discharge_w")
        if why:
            reasons.add(f"{s['probe']}: {why}")
    reasons = sorted(reasons)
    if reasons:
        return "; ".join(reasons)
    return "no energy counter or battery discharge power in the samples (fewer than two readings per source?)"
