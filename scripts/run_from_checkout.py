"""Run a module of this checkout's dlfp with nothing installed: python3 scripts/run_from_checkout.py MODULE [ARGS...]

The repository keeps `dlfp.backends`, `dlfp.devices` and `dlfp.workloads` in top-level
folders (setuptools' package-dir maps them at install). This file maps the same four
names at import time, from a finder placed ahead of every `sys.path` entry, so the
order of the path does not matter: a `dlfp/` folder in the working directory (which
`python3 -m` and `python3 -` put first), a `PYTHONPATH` entry or an installed dlfp
cannot take this checkout's place. It needs nothing beyond the standard library.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {
    "dlfp": REPO / "dlfp",
    "dlfp.backends": REPO / "backends",
    "dlfp.devices": REPO / "devices",
    "dlfp.workloads": REPO / "workloads",
}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """The four package roots from this checkout; their submodules then load from these folders."""

    def find_spec(self, name, path=None, target=None):
        folder = PACKAGES.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install() -> None:
    """Put the finder first (once) and forget any dlfp imported before it."""
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder())
    for name in [m for m in sys.modules if m == "dlfp" or m.startswith("dlfp.")]:
        del sys.modules[name]


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__.splitlines()[0])
    install()
    sys.argv = argv  # the module sees its own name as argv[0], as under python -m
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
