"""Temperature probes: sysfs thermal zones and hwmon (through psutil).

Thermal zones: `sys/class/thermal/thermal_zone*/{type,temp}`, temp in
millidegrees Celsius, read under the root. hwmon: psutil.sensors_temperatures(),
which reads the running system's /sys/class/hwmon, so only with the real root.
"""
from __future__ import annotations

from pathlib import Path

import psutil

from dlfp.devices.reading import (
    Reading,
    RootedProbe,
    live_only,
    read_field,
    read_number,
    read_text,
    sys_path,
    unavailable,
)

ZONES = ("sys", "class", "thermal")


class ThermalZoneProbe(RootedProbe):
    name = "thermal"

    def read(self) -> list[Reading]:
        folder = sys_path(self.root, *ZONES)
        zones = sorted(folder.glob("thermal_zone*"), key=lambda p: _index(p.name))
        if not zones:
            why = f"no {folder}/thermal_zone* (no ACPI/SoC thermal zones, e.g. a VM)"
            return [unavailable(self.name, "thermal", why)]
        return [self._zone(z) for z in zones]

    def _zone(self, zone: Path) -> Reading:
        values: dict = {}
        missing: dict[str, str] = {}
        read_field(zone / "type", read_text, values, missing, "type")
        read_field(zone / "temp", lambda p: read_number(p) / 1000.0, values, missing, "temp_c")
        if "temp_c" not in values:
            return Reading(self.name, zone.name, values, unavailable=missing.pop("temp_c"), missing=missing)
        return Reading(self.name, zone.name, values, missing=missing)


class HwmonProbe(RootedProbe):
    name = "hwmon"

    def read(self) -> list[Reading]:
        if not self.live:
            return [unavailable(self.name, "hwmon", live_only(self.root, "psutil.sensors_temperatures"))]
        if not hasattr(psutil, "sensors_temperatures"):
            return [unavailable(self.name, "hwmon", "psutil has no sensors_temperatures on this platform")]
        chips = psutil.sensors_temperatures()
        if not chips:
            return [unavailable(self.name, "hwmon", "psutil found no temperature sensors (/sys/class/hwmon is empty)")]
        out = []
        for chip, entries in sorted(chips.items()):
            for i, e in enumerate(entries):
                values = {"temp_c": float(e.current)}
                if e.high:
                    values["high_c"] = float(e.high)
                if e.critical:
                    values["critical_c"] = float(e.critical)
                out.append(Reading(self.name, f"{chip}:{e.label or i}", values))
        return out


def _index(name: str) -> int:
    digits = "".join(c for c in name if c.isdigit())
    return int(digits) if digits else -1
