"""The layout of kept results: `runs/<yyyy-mm-dd>-<name>/`.

A kept run is a dated folder that git tracks (`.gitignore` ignores every other
folder under `runs/`, so a scratch `--out runs/try` never lands in a commit by
accident). It holds `config.json` (dlfp.provenance), the run's own results
(`trials.jsonl`, `summary.json`, ...) and its traces gzip-compressed: a step trace
is tens of megabytes as JSON lines and a few as gzip, and `.gitignore` ignores the
uncompressed copies, which stay beside them for the tools that read them.
"""
from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

KEPT_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9.-]*$")
TRACE_PATTERNS = ("steps-*.jsonl", "requests-*.jsonl", "samples-*.jsonl")


def is_kept(folder: Path) -> bool:
    """True for a folder name that the layout keeps (a date, then a name)."""
    return bool(KEPT_NAME.match(Path(folder).name))


def kept_runs(root: Path) -> list[Path]:
    """The kept run folders under `root` (a `runs/` folder), sorted by name."""
    root = Path(root)
    return sorted(p for p in root.iterdir() if p.is_dir() and is_kept(p)) if root.is_dir() else []


def compress_traces(folder: Path) -> list[Path]:
    """Write `<trace>.jsonl.gz` beside every trace file of `folder`; returns the written paths.

    The gzip header carries no name or time (mtime 0), so the same trace always
    compresses to the same bytes and a rerun of this changes nothing in git.
    """
    written = []
    for pattern in TRACE_PATTERNS:
        for path in sorted(Path(folder).glob(pattern)):
            target = path.with_name(path.name + ".gz")
            with open(path, "rb") as src, open(target, "wb") as raw:
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as dst:
                    shutil.copyfileobj(src, dst)
            written.append(target)
    return written


def load_config(folder: Path) -> dict:
    """A kept run's config.json; ValueError naming the folder where it is missing or unreadable."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder}: no readable config.json ({exc})") from None
