"""Where `dlfp serve` keeps what must outlive it (the Batch API's database), and who holds it.

One server per folder: two runners on one database would run the same queued
requests twice. The holder keeps an advisory lock (`flock`) on `server.lock` for
its whole life; the kernel drops it when the process dies, `kill -9` included, so
a restarted server never finds a stale lock.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

STATE_DIR_ENV = "DLFP_STATE_DIR"
LOCK_NAME = "server.lock"


class StateDirBusy(RuntimeError):
    """Another live process holds the folder."""


def default_state_dir() -> Path:
    """$DLFP_STATE_DIR, else the user's data folder for dlfp (platformdirs)."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    from platformdirs import user_data_dir

    return Path(user_data_dir("dlfp", appauthor=False))


class StateDir:
    """A claimed state folder; `release()` (or the process's end) frees it."""

    def __init__(self, folder: Path):
        self.folder = Path(folder).expanduser().resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = self.folder / LOCK_NAME
        self._fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise StateDirBusy(f"{self.folder} is in use by another dlfp serve (pid {holder})") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
