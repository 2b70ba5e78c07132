"""Thermal governor: background prefill on a duty cycle while the device is hot.

    governor = ThermalGovernor.for_profile(profile, source=sampler.latest)
    engine.background_gate = governor        # callable(now) -> (allow, label)

It holds background work back when any reading says
- `throttling` (CPU thermal_throttle counters rose, NVML thermal/HW slowdown), or
- a temperature (`temp_c`: thermal zones, hwmon, NVML) above `limit_c`, or
- the device runs on battery (`plugged` False) below `battery_min_percent`.
While held, background prefill may run only during the first `duty` of every
`period_s` (fewer background tokens per second, less heat); the foreground is
never gated. While held, a temperature must fall `hysteresis_c` under the limit
to count as cool, so the governor does not flap at the threshold. `source` is
any callable returning readings: `ProbeSampler.latest` (no sysfs I/O on the
engine thread), `ProbeSet(...).read`, or a scripted series in tests. The engine
writes the label of each decision into `StepRecord.governor`:
"clear", or "duty 25% on|off: <why>".
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from dlfp.devices.reading import Reading

log = logging.getLogger("dlfp.governor")
CLEAR = "clear"


class ThermalGovernor:
    def __init__(
        self,
        source: Callable[[], Iterable[Reading]],
        limit_c: float,
        battery_min_percent: float = 0.0,
        duty: float = 0.25,
        period_s: float = 1.0,
        hysteresis_c: float = 3.0,
        poll_s: float = 0.25,
    ):
        if not 0 <= duty < 1:
            raise ValueError(f"duty must be in [0, 1), got {duty}")
        if period_s <= 0 or poll_s < 0 or hysteresis_c < 0:
            raise ValueError("period_s must be > 0; poll_s and hysteresis_c >= 0")
        self.source = source
        self.limit_c = limit_c
        self.battery_min_percent = battery_min_percent
        self.duty = duty
        self.period_s = period_s
        self.hysteresis_c = hysteresis_c
        self.poll_s = poll_s
        self.reason: str | None = None  # why background work is held back now (None: it is not)
        self.since: float | None = None
        self.transitions: list[tuple[float, str | None]] = []  # (time, reason) whenever the hold changes
        self._last_poll: float | None = None

    @classmethod
    def for_profile(cls, profile, source: Callable[[], Iterable[Reading]], **kw) -> "ThermalGovernor":
        return cls(source, profile.thermal_limit_c, profile.battery_min_percent, **kw)

    def __call__(self, now: float) -> tuple[bool, str | None]:
        if self._last_poll is None or now - self._last_poll >= self.poll_s:
            self._last_poll = now
            self._update(self.hold_reason(self.source()), now)
        if self.reason is None:
            return True, CLEAR
        allow = (now - self.since) % self.period_s < self.duty * self.period_s
        return allow, f"duty {self.duty:.0%} {'on' if allow else 'off'}: {self.reason}"

    def hold_reason(self, readings: Iterable[Reading]) -> str | None:
        """Why background work should be held back, from one set of readings (None: it need not)."""
        # Once holding for heat, the bar to clear is lower (hysteresis).
        limit = self.limit_c - (self.hysteresis_c if self.reason else 0.0)
        for r in readings:
            if not r.ok:
                continue
            v = r.values
            if v.get("throttling"):
                return f"{r.probe}:{r.source} throttling"
            temp = v.get("temp_c")
            if temp is not None and temp > limit:
                return f"{r.probe}:{r.source} {temp:.1f} C > {limit:.1f} C"
            percent = v.get("percent")
            if r.probe == "battery" and v.get("plugged") is False and percent is not None \
                    and percent < self.battery_min_percent:
                return f"on battery at {percent:.0f}% < {self.battery_min_percent:.0f}%"
        return None

    def _update(self, reason: str | None, now: float) -> None:
        if (reason is None) != (self.reason is None):
            self.since = now if reason is not None else None
            self.transitions.append((now, reason))
            log.info("background %s at %.3f s: %s", "held" if reason else "released", now, reason or "clear")
        self.reason = reason
