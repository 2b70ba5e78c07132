"""CPU probe: utilisation, current frequency and thermal-throttle hints.

- utilisation: psutil (the running system only);
- frequency: `sys/devices/system/cpu/cpu*/cpufreq/scaling_cur_freq` (kHz) under the
  root, else psutil.cpu_freq() on the running system (which falls back to
  /proc/cpuinfo in a VM without cpufreq);
- other programs' load: `other_cores`, the cores' worth of CPU time that other
  processes used (and the hypervisor stole) since the previous reading: the
  system's busy time minus this process's own (psutil; the running system only);
- throttling: Intel's `sys/devices/system/cpu/cpu*/thermal_throttle/*_throttle_count`
  counters; a reading says `throttling=True` when any counter rose since the
  previous reading of the same probe object.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path

import psutil

from dlfp.devices.reading import Reading, RootedProbe, live_only, read_number, sys_path

CPU_DIR = ("sys", "devices", "system", "cpu")
MIN_INTERVAL_S = 0.1


class CpuProbe(RootedProbe):
    name = "cpu"

    def __init__(self, root: str | Path = "/"):
        super().__init__(root)
        self._throttle_prev: int | None = None
        self._baseline = time.monotonic()
        self._others = OtherLoad() if self.live else None
        if self.live:
            psutil.cpu_percent(interval=None)  # the first call only sets the baseline

    def read(self) -> list[Reading]:
        values: dict = {}
        missing: dict[str, str] = {}
        if self.live:
            # Right after the baseline the figure is noise: the first read waits out MIN_INTERVAL_S.
            wait = MIN_INTERVAL_S - (time.monotonic() - self._baseline)
            values["util_pct"] = psutil.cpu_percent(interval=wait if wait > 0 else None)
            others = self._others.read()
            if others is not None:
                values["other_cores"] = others
        else:
            missing["util_pct"] = live_only(self.root, "psutil")
            missing["other_cores"] = live_only(self.root, "psutil")
        self._frequency(values, missing)
        self._throttle(values, missing)
        return [Reading(self.name, "cpu", values, missing=missing)]

    def _cpus(self) -> list[Path]:
        return sorted(sys_path(self.root, *CPU_DIR).glob("cpu[0-9]*"))

    def _frequency(self, values: dict, missing: dict) -> None:
        khz = []
        for cpu in self._cpus():
            try:
                khz.append(read_number(cpu / "cpufreq" / "scaling_cur_freq"))
            except (OSError, ValueError):
                continue
        if khz:
            values["freq_mhz"] = sum(khz) / len(khz) / 1e3
            values["freq_max_mhz"] = max(khz) / 1e3
            return
        freq = psutil.cpu_freq() if self.live else None
        if freq is not None and freq.current > 0:
            values["freq_mhz"] = float(freq.current)
        else:
            where = sys_path(self.root, *CPU_DIR, "cpu*", "cpufreq", "scaling_cur_freq")
            extra = "" if self.live else f"; {live_only(self.root, 'psutil')}"
            missing["freq_mhz"] = f"no {where} (no cpufreq driver, e.g. a VM){extra}"

    def _throttle(self, values: dict, missing: dict) -> None:
        counts = []
        for cpu in self._cpus():
            for f in ("core_throttle_count", "package_throttle_count"):
                try:
                    counts.append(read_number(cpu / "thermal_throttle" / f))
                except (OSError, ValueError):
                    continue
        if not counts:
            where = sys_path(self.root, *CPU_DIR, "cpu*", "thermal_throttle")
            missing["throttling"] = f"no {where} counters (Intel-only, absent in VMs)"
            return
        total = sum(counts)
        values["throttle_count"] = total
        values["throttling"] = self._throttle_prev is not None and total > self._throttle_prev
        self._throttle_prev = total


class OtherLoad:
    """Cores' worth of CPU time used by everything but this process between two reads.

    Busy time is what psutil's utilisation counts (all but idle and iowait, guest time
    already inside user), so hypervisor steal counts as another's load. The process's
    own threads (the runtime's step threads, the server) are subtracted; children it
    has not waited for (the bench's noisy neighbour) are not, so they count as others.
    """

    def __init__(self, pid: int | None = None):
        # This process's own times from os.times() (a system call; psutil reads and parses
        # /proc/self/stat, ~14 us, and the governor asks at every step); another's from psutil.
        self._proc = None if pid is None or pid == os.getpid() else psutil.Process(pid)
        self._prev = self.snapshot()

    def snapshot(self) -> tuple[float, float, float]:
        """(monotonic time, the system's busy seconds, this process's CPU seconds)."""
        t = psutil.cpu_times()
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        busy = total - t.idle - getattr(t, "iowait", 0.0)
        own = os.times() if self._proc is None else self._proc.cpu_times()
        return time.monotonic(), busy, own.user + own.system

    @staticmethod
    def between(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
        """Cores used by others from one snapshot to a later one."""
        (t0, busy0, own0), (t1, busy1, own1) = before, after
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))

    def read(self) -> float | None:
        """Cores used by others since the previous read (None: too little time has passed)."""
        now = self.snapshot()
        if now[0] - self._prev[0] < MIN_INTERVAL_S:
            return None
        figure, self._prev = self.between(self._prev, now), now
        return figure


class LoadWatch:
    """Other programs' load over the latest `period_s`, up to the moment it is asked.

    The thread governor asks between steps. Read across the whole step before it, a
    neighbour that started late in a long prefill step would be diluted below the slack;
    read on a timer, the figure would be up to a period old when a step the neighbour
    already slowed ends, and the next step would run on every thread beside it (in the
    noisy-neighbour workload a 110 ms step, then one of 260-320 ms on two threads). So a
    thread of its own snapshots the counters every quarter period, and `read()` measures
    from the newest snapshot at least a period old to now: two small /proc reads a step.
    """

    def __init__(self, load: OtherLoad | None = None, period_s: float = 0.2):
        if period_s < MIN_INTERVAL_S:
            raise ValueError(f"period_s must be >= {MIN_INTERVAL_S}, got {period_s}")
        self.load = load or OtherLoad()
        self.period_s = period_s
        self._snapshots: deque[tuple[float, float, float]] = deque(maxlen=6)  # a period and a half of them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> float | None:
        """Cores used by others over the latest period (None: not a period's snapshots yet)."""
        now = self.load.snapshot()
        old = [s for s in list(self._snapshots) if now[0] - s[0] >= self.period_s]
        return self.load.between(old[-1], now) if old else None

    def start(self) -> "LoadWatch":
        if self._thread is None:
            self._stop.clear()
            self._snapshots.append(self.load.snapshot())  # the first window starts now
            self._thread = threading.Thread(target=self._run, name="dlfp-load", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s / 4):
            self._snapshots.append(self.load.snapshot())
