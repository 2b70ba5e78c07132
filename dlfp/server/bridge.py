"""Between the engine thread and the event loop.

The engine calls back on its own thread for every token; the callback only
schedules the event onto the loop (`call_soon_threadsafe`), where it is queued
for the request's reader and counted in the metrics. The loop never waits on a
step, and a reader that went away costs nothing but its cancel.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from dlfp.engine import Engine, InvalidRequest, RequestHandle, TokenEvent
from dlfp.sequence import Request
from dlfp.server.errors import APIError
from dlfp.server.metrics import ServerMetrics

log = logging.getLogger("dlfp.server")


class Submitted:
    """One request in flight, as the event loop sees it."""

    def __init__(self, handle: RequestHandle, t_submit: float, metrics: ServerMetrics):
        self.handle = handle
        self.t_submit = t_submit
        self.last_t: float | None = None
        self.finish_reason: str | None = None  # the engine's
        self.outcome: str | None = None  # the client's: set once, when its response ends
        self._metrics = metrics
        self._pending: deque[TokenEvent] = deque()
        self._ready = asyncio.Event()

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def priority(self) -> str:
        return self.handle.request.priority

    def put(self, ev: TokenEvent) -> None:
        self._pending.append(ev)
        self._ready.set()

    async def next(self) -> TokenEvent:
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popleft()

    async def final(self, expected: bool) -> TokenEvent | None:
        """The final event if it comes next: awaited when the last token is known to be
        the last (the engine sends the finish in the same step), else only if queued."""
        if expected:
            ev = await self.next()
            if ev.finish_reason is not None:
                return ev
            self._pending.appendleft(ev)
        if self._pending and self._pending[0].finish_reason is not None:
            return self._pending.popleft()
        return None

    def sent(self, n_tokens: int) -> None:
        """Tokens that went out to the client (what /metrics counts as generated)."""
        self._metrics.generated.labels(self.priority).inc(n_tokens)

    def conclude(self, reason: str) -> None:
        """The request is over as the client saw it (stop, length, error, abort): counted once."""
        if self.outcome is None:
            self.outcome = reason
            self._metrics.finished.labels(self.priority, reason).inc()

    def cancel(self) -> None:
        """The response is over: free the sequence at the next step (a no-op once it has
        finished). A response that ends without a conclusion was cut short: an abort."""
        self.conclude("abort")
        self._pending.clear()
        if self.finish_reason is None:
            self.handle.cancel()


def engine_failure(engine: Engine) -> str | None:
    """Why the engine cannot take requests (its loop died or stopped), or None while it runs."""
    if engine.failure:
        return engine.failure
    return None if engine.running else "the engine is not running"


def engine_dead(reason: str) -> APIError:
    return APIError(503, f"the engine cannot serve requests: {reason}", type="server_error", code="engine_failed")


class EngineBridge:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        # Requests beyond the sequence slots wait in the engine's queue; at most max_queue of them.
        self.max_in_flight = engine.backend.capabilities.max_sequences + max_queue
        self.in_flight: dict[str, Submitted] = {}
        self.draining = False
        self.at_signal: dict[str, str | None] = {}  # in flight at SIGTERM -> how each ended

    def submit(self, request: Request) -> Submitted:
        """Call on the event loop. Raises APIError (503 when the engine is down, 429 when the queue
        is full) or InvalidRequest if the engine refuses the request."""
        failure = engine_failure(self.engine)
        if failure is not None:
            self.metrics.rejected.labels("503").inc()
            raise engine_dead(failure)
        if len(self.in_flight) >= self.max_in_flight:
            self.metrics.rejected.labels("429").inc()
            raise APIError(429, f"the server queue is full ({self.max_in_flight} requests in flight); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()

        def on_event(ev: TokenEvent) -> None:  # engine thread: must not raise
            try:
                loop.call_soon_threadsafe(self._on_event, ev)
            except RuntimeError:
                pass  # the loop has closed: nobody is listening any more

        t_submit = self.engine.clock()
        try:
            handle = self.engine.submit(request, on_event=on_event)
        except InvalidRequest:
            failure = engine_failure(self.engine)
            if failure is not None:  # refused because the loop died meanwhile, not for the request itself
                self.metrics.rejected.labels("503").inc()
                raise engine_dead(failure) from None
            raise
        sub = Submitted(handle, t_submit, self.metrics)
        self.in_flight[request.request_id] = sub
        self.metrics.in_flight.set(len(self.in_flight))
        return sub

    def _on_event(self, ev: TokenEvent) -> None:  # event loop
        sub = self.in_flight.get(ev.request_id)
        if sub is None:
            return  # an event of a request refused at submit
        priority = sub.handle.request.priority
        if ev.token_id is not None:
            base = sub.t_submit if sub.last_t is None else sub.last_t
            (self.metrics.ttft if sub.last_t is None else self.metrics.itl).labels(priority).observe(ev.t - base)
            sub.last_t = ev.t
        else:
            sub.finish_reason = ev.finish_reason  # /metrics counts it when the client's response ends
            if sub.last_t is not None:  # its prompt was processed (reused or computed)
                reused = ev.cached_tokens or 0
                self.metrics.prompt.labels(priority, "reused").inc(reused)
                self.metrics.prompt.labels(priority, "computed").inc(len(sub.handle.request.prompt_ids) - reused)
            if ev.request_id in self.at_signal:
                self.at_signal[ev.request_id] = ev.finish_reason
            del self.in_flight[ev.request_id]
            self.metrics.in_flight.set(len(self.in_flight))
        if sub.outcome is None:  # nobody reads a concluded request's events
            sub.put(ev)

    def begin_drain(self) -> list[str]:
        """SIGTERM: refuse new requests, remember which ones are still running."""
        self.draining = True
        self.at_signal = {rid: None for rid in self.in_flight}
        return list(self.at_signal)

    def abort_all(self) -> list[str]:
        ids = list(self.in_flight)
        for rid in ids:
            self.engine.abort(rid)
        return ids
