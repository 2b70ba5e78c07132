"""The bundled device profiles: TOML files under devices/profiles/, by name.

Only the files; what a profile means to the controller is dlfp/profiles.py's.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_profiles() -> list[str]:
    folder = resources.files("dlfp.devices") / "profiles"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def profile_text(name_or_path: str) -> str:
    """A bundled profile's TOML by name (`cpu-laptop`), or a TOML file's by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return path.read_text()
    res = resources.files("dlfp.devices") / "profiles" / f"{name_or_path}.toml"
    if not res.is_file():
        raise ValueError(f"unknown device profile {name_or_path!r}; bundled: {', '.join(bundled_profiles())}")
    return res.read_text()
