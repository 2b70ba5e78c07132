"""The Batch API's routes: /v1/files and /v1/batches, shaped as OpenAI's so its clients work unchanged.

Every problem is an OpenAI error body with a 4xx: an upload past the size limit
(413, before more than the limit is read), a malformed file (400 naming the line,
before anything is stored), too many requests in a file (400), too many unfinished
batches (429). The API key middleware covers these routes like every /v1 route.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from dlfp.server.batch_input import ENDPOINTS, file_too_large, parse_input
from dlfp.server.batch_store import FILE_PURPOSES
from dlfp.server.errors import APIError, bad_request
from dlfp.server.limits import read_body

if TYPE_CHECKING:
    from dlfp.server.app import ServerState
    from dlfp.server.batch_service import BatchService

MULTIPART_SLACK = 64 * 1024  # form fields and part headers around the file itself
WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")  # "24h" as OpenAI; any whole number of hours up to 9999
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's metadata limits
LIST_LIMIT = 100


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def install_batch_routes(app: FastAPI, state: ServerState) -> None:
    """The routes over `state.batch`, a BatchService, or None with `state.batch_off` saying why."""

    @app.post("/v1/files")
    async def upload(request: Request):
        svc = _service(state)
        form = await _form(request, svc.limits.max_file_bytes)
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in FILE_PURPOSES:
                raise bad_request(f"purpose must be one of {list(FILE_PURPOSES)}, got {purpose!r}", param="purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("the form needs a 'file' part holding the JSONL", param="file")
            content = await upload.read()
        finally:
            await form.close()  # the spooled temporary file
        await run_in_threadpool(parse_input, content, svc.limits)  # refuses a bad file before it is stored
        return await svc.store.call("add_file", upload.filename or "upload.jsonl", purpose, content)

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None):
        data = await _service(state).store.call("list_files", purpose)
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str):
        return _found(await _service(state).store.call("get_file", file_id), "file", file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        content = _found(await _service(state).store.call("file_content", file_id), "file", file_id)
        return Response(content, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        if not await _service(state).store.call("delete_file", file_id):
            raise _not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        svc = _service(state)
        body = _parse_create(await read_body(request, state.limits.max_body_bytes))
        if body.endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {list(ENDPOINTS)}, got {body.endpoint!r}", param="endpoint")
        hours = WINDOW.match(body.completion_window)
        if hours is None:
            raise bad_request(f"completion_window must be a whole number of hours such as '24h', got "
                              f"{body.completion_window!r}", param="completion_window")
        _check_metadata(body.metadata)
        info = await svc.store.call("get_file", body.input_file_id)
        if info is None or info["purpose"] != "batch":
            raise APIError(404, f"no input file {body.input_file_id!r} with purpose 'batch'", param="input_file_id",
                           code="file_not_found", type="not_found_error")
        content = await svc.store.call("file_content", body.input_file_id)
        lines = await run_in_threadpool(parse_input, content, svc.limits)
        if lines[0].url != body.endpoint:
            raise bad_request(f"the file's requests are for {lines[0].url}, not the endpoint {body.endpoint}",
                              param="endpoint")
        batch = await svc.store.call("create_batch", body.input_file_id, state.model_name, body.endpoint,
                                     body.completion_window, int(hours.group(1)) * 3600, body.metadata, lines,
                                     svc.limits.max_active)
        if batch is None:
            raise APIError(429, f"{svc.limits.max_active} batches are unfinished, this server's limit "
                                f"(--batch-max-queued); retry when one ends", type="rate_limit_error",
                           code="too_many_batches")
        svc.runner.add(batch["id"], [x.line for x in lines], batch["expires_at"])
        return batch

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = 20):
        if not 1 <= limit <= LIST_LIMIT:
            raise bad_request(f"limit must be between 1 and {LIST_LIMIT}, got {limit}", param="limit")
        data, more = await _service(state).store.call("list_batches", after, limit)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str):
        return _found(await _service(state).store.call("get_batch", batch_id), "batch", batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        svc = _service(state)
        batch = _found(await svc.store.call("cancel", batch_id), "batch", batch_id)
        if batch["status"] in ("completed", "failed", "expired"):
            raise APIError(409, f"batch {batch_id} is {batch['status']}: there is nothing to cancel",
                           param="batch_id", code="batch_not_cancellable")
        if batch["status"] == "cancelling" and batch["model"] == state.model_name:
            await svc.runner.cancel(batch_id)  # another model's batch is finalized by a server of that model
            batch = await svc.store.call("get_batch", batch_id)
        return batch


def _service(state: ServerState) -> BatchService:
    """The server's BatchService, refusing while it is off (503) or the server drains (503)."""
    if state.batch is None:
        raise APIError(503, f"the Batch API is off on this server: {state.batch_off}", type="server_error",
                       code="batch_unavailable")
    if state.bridge.draining:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                       headers={"Retry-After": "5", "Connection": "close"})
    return state.batch


async def _form(request: Request, max_file_bytes: int):
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "multipart/form-data":
        raise APIError(415, f"upload the file as multipart/form-data, got {media or 'none'!r}",
                       code="unsupported_media_type")
    limit = max_file_bytes + MULTIPART_SLACK
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise file_too_large(max_file_bytes)
    parser = MultiPartParser(request.headers, _limited(request, limit, max_file_bytes), max_files=1, max_fields=8)
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise bad_request(f"the upload is not a valid multipart form: {exc.message}", param="file") from None


async def _limited(request: Request, limit: int, max_file_bytes: int) -> AsyncIterator[bytes]:
    """The body, stopped with a 413 as soon as it passes `limit` bytes (a chunked upload has no length)."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise file_too_large(max_file_bytes)
        yield chunk


def _parse_create(raw: bytes) -> CreateBatch:
    try:
        return CreateBatch.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        param = str(err["loc"][0]) if err["loc"] else None
        raise bad_request(f"{param or 'body'}: {err['msg']}", param=param) from None


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata may have at most {MAX_METADATA_KEYS} keys", param="metadata")
    if any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()):
        raise bad_request(f"metadata keys may have at most {MAX_METADATA_KEY} characters and values "
                          f"{MAX_METADATA_VALUE}", param="metadata")


def _found(value, kind: str, ident: str):
    if value is None:
        raise _not_found(kind, ident)
    return value


def _not_found(kind: str, ident: str) -> APIError:
    return APIError(404, f"no {kind} with id {ident!r}", type="not_found_error", code=f"{kind}_not_found")
