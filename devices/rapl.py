"""RAPL energy counters (Intel, and AMD Zen through the same powercap driver).

`sys/class/powercap/intel-rapl:N` is a package domain, `intel-rapl:N:M` its
sub-domains (core, uncore, dram); each has `name`, `energy_uj` (a cumulative
counter in microjoules) and `max_energy_range_uj` (where the counter wraps to 0).
A reading carries the raw counter; `dlfp.devices.energy` unwraps it. Since
Linux 5.10 `energy_uj` is readable by root only (CVE-2020-8694, the PLATYPUS
power side channel), which this probe reports as the reason.
"""
from __future__ import annotations

from pathlib import Path

from dlfp.devices.reading import Reading, RootedProbe, read_field, read_number, read_text, sys_path, unavailable

POWERCAP = ("sys", "class", "powercap")
ROOT_ONLY = (
    "{path} is readable by root only (Linux >= 5.10, CVE-2020-8694): run as root, or "
    "`sudo chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj` (until reboot)"
)


class RaplProbe(RootedProbe):
    name = "rapl"

    def read(self) -> list[Reading]:
        folder = sys_path(self.root, *POWERCAP)
        domains = sorted(folder.glob("intel-rapl:*"))
        if not domains:
            return [unavailable(
                self.name, "rapl",
                f"no {folder}/intel-rapl:* (not an x86 machine with RAPL, a VM, or intel_rapl is not loaded)",
            )]
        return [self._domain(d) for d in domains]

    def _domain(self, d: Path) -> Reading:
        values: dict = {"top_level": d.name.count(":") == 1}
        missing: dict[str, str] = {}
        read_field(d / "name", read_text, values, missing, "domain")
        read_field(d / "max_energy_range_uj", read_number, values, missing, "max_energy_range_uj")
        try:
            values["energy_uj"] = read_number(d / "energy_uj")
        except PermissionError:
            why = ROOT_ONLY.format(path=d / "energy_uj")
            return Reading(self.name, d.name, values, unavailable=why, missing=missing)
        except (OSError, ValueError) as exc:
            return Reading(self.name, d.name, values, unavailable=f"{d / 'energy_uj'}: {exc}", missing=missing)
        return Reading(self.name, d.name, values, missing=missing)
