"""The ASGI application: routes, error bodies, and the engine's lifetime."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from dlfp.engine import Engine
from dlfp.server.batch_routes import install_batch_routes
from dlfp.server.batch_service import BatchOptions, BatchService
from dlfp.server.bridge import EngineBridge, engine_dead, engine_failure
from dlfp.server.completions import resolve_priority, respond
from dlfp.server.errors import APIError, bad_request
from dlfp.server.exposure import Exposure, install
from dlfp.server.jobs import chat_job, completion_job
from dlfp.server.limits import RequestLimits, read_body
from dlfp.server.metrics import ServerMetrics
from dlfp.server.schemas import ChatRequest, CompletionRequest, parse, unknown_model
from dlfp.server.state_dir import StateDirBusy
from dlfp.trace import step_row

log = logging.getLogger("dlfp.server")
OWNED_BY = "dlfp"  # how a client (dlfp's endpoint bench) recognises a server that takes `priority`
# A server runs for days: it keeps only its latest records. Steps: a few minutes' worth (a step
# is a few ms to a few hundred), for GET /steps; requests and probe samples: for debugging.
STEP_KEEP = 4096
TRACE_KEEP = 512


@dataclass(frozen=True)
class ServeOptions:
    """Everything `dlfp serve` bounds or guards, as the command line set it."""

    max_queue: int = 64
    max_body_bytes: int = 8 * 2**20
    max_tokens_limit: int | None = None
    host: str = "127.0.0.1"
    exposure: Exposure = Exposure()
    batch: BatchOptions | None = None  # None: no Batch API (its routes answer 503)


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    policy: str
    options: ServeOptions = ServeOptions()

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine)
        self.bridge = EngineBridge(self.engine, self.metrics, self.options.max_queue)
        self.limits = RequestLimits(self.options.max_body_bytes, self.options.max_tokens_limit,
                                    self.engine.backend.max_token_bytes())
        self.created = int(time.time())
        self.engine.step_hooks.append(self._bound_trace)
        self.batch: BatchService | None = None
        self.batch_off = "no --state-dir was given"
        if self.options.batch is not None:
            try:
                self.batch = BatchService(self.options.batch, self.metrics.registry)
            except StateDirBusy as exc:  # the chat API still serves; the batch routes say why they do not
                self.batch_off = f"{exc}; give this server its own --state-dir"

    @property
    def backend(self):
        return self.engine.backend

    def _bound_trace(self, _rec) -> None:  # engine thread, the trace's only regular writer
        self.engine.trace.drop_oldest(STEP_KEEP, TRACE_KEEP)

    def steps_since(self, since_unix: float) -> dict:
        """The kept steps that began at `since_unix` or later, each with its decision record,
        times in Unix seconds (a client on another clock aligns them by the wall clock);
        `complete`: no step after `since_unix` was dropped."""
        offset = time.time() - self.engine.clock()
        trace = self.engine.trace
        rows = [step_row(s, -offset) for s in trace.steps_since(since_unix - offset)]
        dropped = trace.steps_dropped_until
        return {"object": "list", "data": rows, "complete": dropped is None or dropped + offset < since_unix}

    def check_model(self, name: str | None) -> str:
        if name is not None and name != self.model_name:
            raise unknown_model(name)
        return self.model_name

    def summarize_shutdown(self, aborted_now: list[str]) -> str:
        outcome = dict(self.bridge.at_signal)
        outcome.update({rid: "abort" for rid in aborted_now})
        finished = sorted(r for r, why in outcome.items() if why in ("stop", "length"))
        cut = sorted(r for r, why in outcome.items() if why not in ("stop", "length"))
        return (f"shutdown: {len(outcome)} request(s) in flight at the signal; "
                f"finished {len(finished)}: {', '.join(finished) or '-'}; "
                f"aborted {len(cut)}: {', '.join(cut) or '-'}")


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        if state.batch is not None:
            await state.batch.start(state)
        yield
        if state.batch is not None:
            await state.batch.stop()  # before the engine: unfinished batch requests stay queued on disk
        aborted = state.engine.shutdown(abort_pending=True, timeout=10.0)
        log.warning(state.summarize_shutdown(aborted))

    app = FastAPI(title="dlfp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)
    install(app, state.options.exposure, state.options.host)
    install_batch_routes(app, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatRequest, await _body(state, request))
        job = await chat_job(state, body, resolve_priority(body, request.headers.get("x-priority")),
                             headers=request.headers)
        return await respond(state.bridge, job, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await _body(state, request))
        job = await completion_job(state, body, resolve_priority(body, request.headers.get("x-priority")),
                                   headers=request.headers)
        return await respond(state.bridge, job, request)

    @app.get("/v1/models")
    async def models():
        caps = state.backend.capabilities
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": OWNED_BY,
                "max_model_len": caps.context_per_sequence, "vocab_size": caps.vocab_size, "policy": state.policy}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        failure = engine_failure(state.engine)
        if failure is not None:  # a supervisor should restart this server
            return JSONResponse({"status": "failed", "error": failure, "policy": state.policy,
                                 "in_flight": len(state.bridge.in_flight)}, status_code=503)
        load = state.engine.load() | {"free_slots": len(state.engine.scheduler.free_slots),
                                      "in_flight": len(state.bridge.in_flight)}
        if state.batch is not None:  # resuming batches never makes the server unhealthy
            load["batch"] = state.batch.health()
        status = "draining" if state.bridge.draining else "ok"
        return JSONResponse({"status": status, "policy": state.policy, **load},
                            status_code=503 if state.bridge.draining else 200)

    @app.get("/steps")
    async def steps(since: float = 0.0):
        # Counts and times only, no text: exposed as /metrics is. Its rows are built and encoded
        # on a worker thread (~25 us a step: 0.1 s for all it keeps), not on the streams' loop.
        return await asyncio.to_thread(lambda: JSONResponse(state.steps_since(since)))

    @app.get("/metrics")
    async def metrics():
        if state.batch is not None:
            await state.batch.refresh_metrics()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _body(state: ServerState, request: Request) -> bytes:
    """The body of a request the server will take: refused while draining or when the engine is
    down (503), and before parsing when it is not JSON (415) or too large (413)."""
    if state.bridge.draining:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                       headers={"Retry-After": "5", "Connection": "close"})
    failure = engine_failure(state.engine)
    if failure is not None:
        state.metrics.rejected.labels("503").inc()
        raise engine_dead(failure)
    return await read_body(request, state.limits.max_body_bytes)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()  # 405: Allow

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return bad_request(str(exc)).response()

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):  # a bug: still an OpenAI error body, and logged
        log.exception("unhandled error in a request")
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()
