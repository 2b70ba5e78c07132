"""Battery probe: charge, plugged in, and discharge power.

Reads `sys/class/power_supply/BAT*` (laptops) or `.../battery` (Android) under
the root: `capacity` (%), `status` (Charging/Discharging/Full/Not charging),
`power_now` (uW) or `current_now` (uA) x `voltage_now` (uV). "Plugged in" comes
from a mains/USB supply's `online` file when there is one, else from the status.
With the real root and no such folder, psutil.sensors_battery() is asked too.
"""
from __future__ import annotations

from pathlib import Path

import psutil

from dlfp.devices.reading import Reading, RootedProbe, read_field, read_number, read_text, sys_path, unavailable

SUPPLIES = ("sys", "class", "power_supply")
DISCHARGING = "Discharging"


class BatteryProbe(RootedProbe):
    name = "battery"

    def read(self) -> list[Reading]:
        folder = sys_path(self.root, *SUPPLIES)
        batteries = sorted(folder.glob("BAT*")) + sorted(folder.glob("battery"))
        if batteries:
            mains = _mains_online(folder)
            return [self._battery(b, mains) for b in batteries]
        if self.live:
            fallback = self._psutil()
            if fallback is not None:
                return [fallback]
        return [unavailable(self.name, "battery", f"no {folder}/BAT* or battery (no battery: a desktop, server or VM)")]

    def _battery(self, bat: Path, mains: bool | None) -> Reading:
        values: dict = {}
        missing: dict[str, str] = {}
        read_field(bat / "capacity", lambda p: float(read_number(p)), values, missing, "percent")
        read_field(bat / "status", read_text, values, missing, "status")
        status = values.get("status")
        if mains is not None:
            values["plugged"] = mains
        elif status is not None:
            values["plugged"] = status != DISCHARGING
        else:
            missing["plugged"] = "neither a mains supply's online file nor a battery status"
        if status == DISCHARGING:
            watts = _power_w(bat, missing)
            if watts is not None:
                values["discharge_w"] = watts
        else:
            missing["discharge_w"] = f"not discharging (status {status})"
        return Reading(self.name, bat.name, values, missing=missing)

    def _psutil(self) -> Reading | None:
        if not hasattr(psutil, "sensors_battery"):
            return None
        b = psutil.sensors_battery()
        if b is None:
            return None
        values = {"percent": float(b.percent)}
        if b.power_plugged is not None:
            values["plugged"] = bool(b.power_plugged)
        missing = {"discharge_w": "psutil gives no power figure"}
        return Reading(self.name, "psutil", values, missing=missing)


def _power_w(bat: Path, missing: dict) -> float | None:
    try:
        return abs(read_number(bat / "power_now")) / 1e6
    except (OSError, ValueError):
        pass
    try:
        return abs(read_number(bat / "current_now") * read_number(bat / "voltage_now")) / 1e12
    except (OSError, ValueError):
        missing["discharge_w"] = f"no readable power_now, or current_now and voltage_now, in {bat}"
        return None


def _mains_online(folder: Path) -> bool | None:
    """True/False when a mains or USB supply says whether it is online; None when none does."""
    seen = None
    for supply in folder.iterdir():
        try:
            kind = read_text(supply / "type")
            if kind not in ("Mains", "USB", "USB_C", "USB_PD"):
                continue
            online = read_number(supply / "online") == 1
        except (OSError, ValueError):
            continue
        seen = bool(seen) or online
    return seen
