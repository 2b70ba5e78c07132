"""Lines of a batch's output and error files, in the OpenAI Batch API's shape.

Every line is `{"id", "custom_id", "response", "error"}`. An answered request
has `response = {"status_code": 200, "request_id", "body"}` and `error = null`;
a failed one has the HTTP error the request would have got as `response` and
`error = {"code", "message", "param", "line"}` with its line in the input file.
A request that never ran (the batch was cancelled or expired) has `response = null`.
"""
from __future__ import annotations

import json

from dlfp.server.errors import APIError

CANCELLED, EXPIRED = "batch_cancelled", "batch_expired"


def request_id(batch_id: str, line: int) -> str:
    """The id of one request of a batch: the same on every run, so a resumed request gets
    the same id (and, without a seed, the same sampling seed) as an uninterrupted one."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def answered(batch_id: str, line: int, custom_id: str, body: dict) -> str:
    response = {"status_code": 200, "request_id": body.get("id"), "body": body}
    return _line(batch_id, line, custom_id, response, None)


def failed(batch_id: str, line: int, custom_id: str, err: APIError) -> str:
    response = {"status_code": err.status, "request_id": None, "body": err.body()}
    error = {"code": err.code or err.type, "message": f"line {line}: {err.message}", "param": err.param,
             "line": line}
    return _line(batch_id, line, custom_id, response, error)


def not_run(batch_id: str, line: int, custom_id: str, code: str) -> str:
    why = "the batch was cancelled" if code == CANCELLED else "the batch expired"
    error = {"code": code, "message": f"line {line}: not run: {why} before it started", "param": None, "line": line}
    return _line(batch_id, line, custom_id, None, error)


def _line(batch_id: str, line: int, custom_id: str, response: dict | None, error: dict | None) -> str:
    return json.dumps({"id": request_id(batch_id, line), "custom_id": custom_id, "response": response,
                       "error": error}, ensure_ascii=False)
