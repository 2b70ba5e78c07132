"""CPU pressure (Linux PSI, `/proc/pressure/cpu`): the time some runnable task waited for a core.

Its `some ... total=` counter is microseconds, updated as tasks wait, so the share of a
few milliseconds in which some task waited says at once that the cores are
oversubscribed: a step on every core beside another program that has just started. The
once-a-period load reading the thread governor uses (`devices/cpu.py`) says so only at
its next read; a step on several threads slows 2-4x in between (its threads wait at each
op for the one descheduled).
"""
from __future__ import annotations

from pathlib import Path

PSI_CPU = Path("/proc/pressure/cpu")


def cpu_stall_reader(path: Path = PSI_CPU):
    """A function returning the seconds some task has waited for a core (cumulative), or
    None where the kernel has no PSI (CONFIG_PSI off, psi=0, not Linux)."""
    try:
        with open(path, "rb") as f:
            _parse(f.read())
    except (OSError, ValueError):
        return None

    def stalled_s() -> float:
        with open(path, "rb") as f:
            return _parse(f.read())

    return stalled_s


def _parse(text: bytes) -> float:
    for line in text.splitlines():
        if line.startswith(b"some "):
            for field in line.split():
                if field.startswith(b"total="):
                    return int(field[6:]) / 1e6
    raise ValueError(f"no 'some ... total=' line in {text[:80]!r}")
