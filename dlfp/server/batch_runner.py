"""Runs the stored batches' requests through the engine at background priority.

Oldest batch first, requests in line order, at most `window` in flight (default:
the engine's sequence slots, so one request waits ready in the engine's queue
whenever a slot frees). Each request goes through the same checks as the same body
sent to /v1 (`dlfp.server.jobs`), always as background work, so the scheduler keeps
the foreground chat's ITL goal while a batch runs.

What is in flight lives only in memory: a request's row stays `queued` until its
result is committed, so after a crash the rows still queued are run again, and a
request aborted by a shutdown or a cancel is simply not recorded. A request id
derived from (batch, line) gives a resumed request the same sampling seed as an
uninterrupted run.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from typing import TYPE_CHECKING

from dlfp.engine import InvalidRequest
from dlfp.sequence import BACKGROUND
from dlfp.server import batch_output
from dlfp.server.batch_store import Usage
from dlfp.server.bridge import engine_failure
from dlfp.server.completions import collect
from dlfp.server.errors import APIError, bad_request
from dlfp.server.jobs import chat_job, completion_job
from dlfp.server.schemas import ChatRequest, CompletionRequest, parse

if TYPE_CHECKING:
    from dlfp.server.app import ServerState
    from dlfp.server.batch_service import AsyncStore

log = logging.getLogger("dlfp.server.batch")
RETRY_S = 0.2  # the engine's queue was full (chat requests hold it): try again this much later
IDLE_CHECK_S = 30.0  # with nothing to run, look for expired batches this often


class BatchRunner:
    def __init__(self, store: AsyncStore, state: ServerState, window: int):
        self.store = store
        self.state = state
        self.window = max(1, window)
        self.queues: dict[str, deque[int]] = {}  # batch id -> lines still to start, oldest batch first
        self.expires: dict[str, int | None] = {}
        self.running: dict[str, dict[int, object]] = {}  # batch id -> line -> Submitted (None while preparing)
        self.ending: dict[str, str] = {}  # batch id -> "cancelled" or "expired", once it is being stopped
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.recovered = asyncio.Event()  # the stored work is loaded (after a restart: resumed)

    # -- what the routes call ------------------------------------------------
    def add(self, batch_id: str, lines: list[int], expires_at: int | None) -> None:
        self.queues[batch_id] = deque(lines)
        self.expires[batch_id] = expires_at
        self.running.setdefault(batch_id, {})
        self._wake.set()

    async def cancel(self, batch_id: str) -> None:
        """Start no more of its requests and abort the running ones; finished ones are kept."""
        await self._stop(batch_id, "cancelled")

    async def _stop(self, batch_id: str, status: str) -> None:
        self.ending[batch_id] = status
        self.queues.pop(batch_id, None)
        self.expires.pop(batch_id, None)
        self.running.setdefault(batch_id, {})
        for sub in self.running[batch_id].values():
            if sub is not None:
                sub.handle.cancel()  # the engine's abort: its final event still reaches the waiting task
        await self._settle(batch_id)

    def in_flight(self) -> int:
        return sum(len(r) for r in self.running.values())

    # -- the loop ------------------------------------------------------------
    async def run(self) -> None:
        await self._recover()
        slots = asyncio.Semaphore(self.window)
        while True:
            await slots.acquire()
            batch_id, line = await self._next()
            self.running[batch_id][line] = None
            task = asyncio.create_task(self._execute(batch_id, line))
            self._tasks.add(task)
            task.add_done_callback(lambda t: (self._tasks.discard(t), slots.release(), _log_crash(t)))

    async def _recover(self) -> None:
        """Load every unfinished batch of this server's model; finish those a crash left with nothing to run.
        A batch made for another model waits, untouched, for a server of that model."""
        for batch_id, model, status, expires_at in await self.store.call("active_batches"):
            if model != self.state.model_name:
                log.warning("%s was made for model %s, not %s: it waits for a server of that model",
                            batch_id, model, self.state.model_name)
                continue
            lines = await self.store.call("queued_lines", batch_id)
            if status == "cancelling":
                await self._stop(batch_id, "cancelled")
                continue
            self.add(batch_id, lines, expires_at)
            if lines:
                log.warning("resuming %s: %d request(s) to run", batch_id, len(lines))
            await self._settle(batch_id)
        self.recovered.set()

    async def _next(self) -> tuple[str, int]:
        while True:
            if not self.state.bridge.draining:  # a shutting-down server starts nothing new
                await self._expire()
                for batch_id, lines in self.queues.items():
                    if lines:
                        return batch_id, lines.popleft()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_CHECK_S)
            except asyncio.TimeoutError:
                pass

    async def _expire(self) -> None:
        now = self.store.now()
        for batch_id in [b for b, t in self.expires.items() if t is not None and now >= t]:
            log.warning("%s expired (its completion window ended)", batch_id)
            await self._stop(batch_id, "expired")

    async def _execute(self, batch_id: str, line: int) -> None:
        try:
            outcome = await self._attempt(batch_id, line)
        except Exception as exc:  # a bug, or the disk: fail this request only, and say why
            log.exception("batch %s line %d", batch_id, line)
            outcome = await self._fail(batch_id, line, None, APIError(
                500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
        finally:
            self.running[batch_id].pop(line, None)
        if outcome == "retry" and batch_id in self.queues:
            self.queues[batch_id].appendleft(line)
            await asyncio.sleep(RETRY_S)  # holds its window slot meanwhile: no busy loop
            self._wake.set()
            return
        await self._settle(batch_id)

    async def _attempt(self, batch_id: str, line: int) -> str:
        """Run one request and commit its result: 'done', 'failed', or 'retry' (not recorded)."""
        custom_id, url, body = await self.store.call("request", batch_id, line)
        try:
            job = await _job(self.state, url, body, batch_output.request_id(batch_id, line))
            sub = self.state.bridge.submit(job.request)
        except InvalidRequest as exc:
            return await self._fail(batch_id, line, custom_id, bad_request(str(exc)))
        except APIError as err:
            if err.status in (429, 503):
                return "retry"  # a full queue or an engine that is down is no fault of this request
            return await self._fail(batch_id, line, custom_id, err)
        self.running[batch_id][line] = sub
        if batch_id in self.ending:  # stopped while this one was being prepared
            sub.handle.cancel()
        try:
            answer = await collect(self.state.bridge, job, sub)
        except APIError as err:
            if err.code == "aborted" or sub.finish_reason == "abort" or engine_failure(self.state.engine):
                return "retry"  # a shutdown, a cancel or a dead engine cut it short: it runs again, or never
            return await self._fail(batch_id, line, custom_id, err)
        finally:
            sub.cancel()  # a no-op for a finished request
        usage = answer["usage"]
        await self.store.call("finish", batch_id, line, True,
                              batch_output.answered(batch_id, line, custom_id, answer),
                              Usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                                    usage["completion_tokens"]))
        return "done"

    async def _fail(self, batch_id: str, line: int, custom_id: str | None, err: APIError) -> str:
        if custom_id is None:
            custom_id = (await self.store.call("request", batch_id, line))[0]
        await self.store.call("finish", batch_id, line, False, batch_output.failed(batch_id, line, custom_id, err))
        return "failed"

    async def _settle(self, batch_id: str) -> None:
        """Finalize a batch once nothing of it is queued or running."""
        if self.queues.get(batch_id) or self.running.get(batch_id):
            return
        status = self.ending.pop(batch_id, "completed")
        self.queues.pop(batch_id, None)
        self.expires.pop(batch_id, None)
        self.running.pop(batch_id, None)
        batch = await self.store.call("finalize", batch_id, status)
        counts = batch["request_counts"]
        log.warning("%s %s: %d done, %d failed of %d", batch_id, status, counts["completed"], counts["failed"],
                    counts["total"])


async def _job(state, url: str, body: dict, request_id: str):
    raw = json.dumps(body).encode()
    if url == "/v1/chat/completions":
        parsed = parse(ChatRequest, raw)
    else:
        parsed = parse(CompletionRequest, raw)
    if parsed.stream:
        raise bad_request("stream is not supported in a batch: the answer goes to the output file", param="stream")
    make = chat_job if url == "/v1/chat/completions" else completion_job
    return await make(state, parsed, BACKGROUND, request_id)


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a batch request crashed the runner's task", exc_info=task.exception())
