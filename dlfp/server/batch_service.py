"""The Batch API's parts for one server: its claimed state folder, the database, the runner, /metrics.

The database is reached through one worker thread (`AsyncStore`): SQLite commits
wait on the disk (an fsync each), and the event loop that relays the chat's
tokens must not.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

from dlfp.server.batch_input import BatchLimits
from dlfp.server.batch_runner import BatchRunner
from dlfp.server.batch_store import ACTIVE, TERMINAL, BatchStore
from dlfp.server.state_dir import StateDir

if TYPE_CHECKING:
    from dlfp.server.app import ServerState

log = logging.getLogger("dlfp.server.batch")


@dataclass(frozen=True)
class BatchOptions:
    state_dir: Path
    limits: BatchLimits = field(default_factory=BatchLimits)
    in_flight: int | None = None  # batch requests in the engine at once (default: its sequence slots)


class AsyncStore:
    """A BatchStore whose every call runs on one worker thread, in the order made."""

    def __init__(self, store: BatchStore):
        self.store = store
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlfp-batch-db")

    async def call(self, method: str, *args):
        fn = functools.partial(getattr(self.store, method), *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def now(self) -> int:
        return self.store.now()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()


class BatchService:
    def __init__(self, options: BatchOptions, registry: CollectorRegistry):
        self.dir = StateDir(options.state_dir)  # raises StateDirBusy: one server per folder
        self.options = options
        self.limits = options.limits
        self.store = AsyncStore(BatchStore(self.dir.folder))
        self.runner: BatchRunner | None = None
        self._task: asyncio.Task | None = None
        self._gauges = _Gauges(registry)

    @property
    def path(self) -> Path:
        return self.store.store.path

    async def start(self, state: ServerState) -> None:
        """Start the runner (on the server's event loop); it resumes whatever the database holds."""
        slots = state.backend.capabilities.max_sequences
        self.runner = BatchRunner(self.store, state, self.options.in_flight or slots)
        self._task = asyncio.create_task(self.runner.run(), name="dlfp-batch-runner")
        self._task.add_done_callback(_log_end)

    async def stop(self) -> None:
        """Stop starting requests; whatever is unfinished stays queued in the database for the next start."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            tasks = list(self.runner._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.store.close()
        self.dir.release()

    def health(self) -> dict:
        """For /health: whether the stored work is loaded, what runs, and why the runner stopped if it did."""
        runner, task = self.runner, self._task
        error = None
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            error = f"{type(task.exception()).__name__}: {task.exception()}"
        return {"resumed": bool(runner and runner.recovered.is_set()),
                "in_flight": runner.in_flight() if runner else 0, "error": error}

    async def refresh_metrics(self) -> None:
        stats = await self.store.call("stats")
        self._gauges.set(stats, self.runner.in_flight() if self.runner else 0)


class _Gauges:
    def __init__(self, r: CollectorRegistry):
        self.batches = Gauge("dlfp_batches", "Batches in the Batch API's database, per status", ["status"],
                             registry=r)
        self.requests = Gauge("dlfp_batch_requests", "Requests of stored batches: done and failed (all batches), "
                              "queued (unfinished batches: not yet answered)", ["state"], registry=r)
        self.running = Gauge("dlfp_batch_requests_running", "Batch requests in the engine now", registry=r)
        self.journal = Gauge("dlfp_batch_journal_bytes", "The Batch API's database on disk, its write-ahead log "
                             "included", registry=r)

    def set(self, stats: dict, running: int) -> None:
        for status in ACTIVE + TERMINAL:
            self.batches.labels(status).set(stats["batches"].get(status, 0))
        for state, n in stats["requests"].items():
            self.requests.labels(state).set(n)
        self.running.set(running)
        self.journal.set(stats["journal_bytes"])


def _log_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the batch runner stopped: batches wait for a restart", exc_info=task.exception())
