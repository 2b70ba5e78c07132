"""Probe readings sampled into a run's trace, on a thread.

    from dlfp.devices.sampler import ProbeSampler
    from dlfp.devices.energy import energy_report

    with ProbeSampler(engine.trace, period_s=0.5) as sampler:   # root="/" by default
        ... run the workload ...
    report = energy_report(engine.trace.samples, t0, t1, engine.trace.steps, engine.trace.requests)
    report["energy_j"], report["j_per_output_token"], report["per_class"], report["peak_temp_c"]

Each tick appends one dict per reading through `trace.add_sample`:
`{"t": time.perf_counter(), "probe": "rapl", "source": "intel-rapl:0", "energy_uj": ...}`,
with `"unavailable": reason` (and `"missing": {field: reason}`) where a probe
read nothing. `t` is on the engine's default clock, so samples line up with
steps and requests; `Trace.write` shifts it to the trace origin like the rest.
The sampler reads once on start and once on stop, so a run is bracketed.
`sampler.latest()` gives the last readings without touching sysfs: the thermal
governor reads that on the engine thread:

    engine.background_gate = ThermalGovernor.for_profile(profile, source=sampler.latest)
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from dlfp.devices.probes import ProbeSet
from dlfp.devices.reading import Reading


class ProbeSampler:
    def __init__(
        self,
        trace,
        period_s: float = 0.5,
        root: str | Path = "/",
        probes: ProbeSet | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.trace = trace
        self.period_s = period_s
        self.clock = clock
        self._own_probes = probes is None
        self.probes = probes or ProbeSet(root)
        self._latest: list[Reading] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0

    def sample_once(self) -> list[Reading]:
        readings = self.probes.read()
        t = self.clock()
        for r in readings:
            self.trace.add_sample(r.as_sample(t))
        with self._lock:
            self._latest = readings
        self.ticks += 1
        return readings

    def latest(self) -> list[Reading]:
        with self._lock:
            return list(self._latest)

    def start(self) -> "ProbeSampler":
        if self._thread is None:
            self.sample_once()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dlfp-probes", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample_once()
        if self._own_probes:
            self.probes.close()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample_once()

    def __enter__(self) -> "ProbeSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
