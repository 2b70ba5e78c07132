"""A Batch API input file: JSONL lines of `{custom_id, method, url, body}`, checked whole at upload.

The envelope of every line (JSON object, a unique `custom_id`, `POST`, one of the
served endpoints, an object `body`) is checked before the file is stored, and the
first bad line refuses the whole upload with its line number. What is inside a
`body` is checked only when its request runs: a bad body fails that request alone
(it goes to the batch's error file) and the rest of the batch goes on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from dlfp.server.errors import APIError, bad_request

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLimits:
    """What the Batch API accepts before it refuses with a 4xx."""

    max_file_bytes: int = 100 * 2**20  # HTTP 413 past this
    max_lines: int = 50_000  # requests per file, so per batch (HTTP 400)
    max_active: int = 16  # batches accepted and not yet finished (HTTP 429 past this)


@dataclass(frozen=True)
class InputLine:
    line: int  # 1-based line number in the uploaded file, as an editor shows it
    custom_id: str
    url: str
    body: dict


def parse_input(content: bytes, limits: BatchLimits) -> list[InputLine]:
    """Every request of an input file, or an APIError naming the first bad line."""
    if len(content) > limits.max_file_bytes:
        raise file_too_large(limits.max_file_bytes)
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the file is not UTF-8 text (byte {exc.start})", param="file",
                          code="invalid_file") from None
    lines: list[InputLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline, a gap) are not requests
        if len(lines) == limits.max_lines:
            raise bad_request(f"the file has more than {limits.max_lines} requests, this server's limit per batch "
                              f"(--batch-max-lines)", param="file", code="too_many_requests_in_file")
        item = _envelope(number, raw)
        if item.custom_id in seen:
            raise _bad_line(number, f"custom_id {item.custom_id!r} repeats line {seen[item.custom_id]}; "
                                    f"each request needs its own")
        if lines and item.url != lines[0].url:
            raise _bad_line(number, f"url {item.url!r} differs from line {lines[0].line}'s {lines[0].url!r}; "
                                    f"a batch file serves one endpoint")
        seen[item.custom_id] = number
        lines.append(item)
    if not lines:
        raise bad_request("the file has no requests", param="file", code="invalid_file")
    return lines


def _envelope(number: int, raw: str) -> InputLine:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _bad_line(number, f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _bad_line(number, "each line must be a JSON object")
    custom_id, method, url, body = (obj.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise _bad_line(number, f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID_CHARS} characters")
    if method != "POST":
        raise _bad_line(number, f"method must be 'POST', got {method!r}")
    if url not in ENDPOINTS:
        raise _bad_line(number, f"url must be one of {list(ENDPOINTS)}, got {url!r}")
    if not isinstance(body, dict):
        raise _bad_line(number, "body must be a JSON object")
    return InputLine(number, custom_id, url, body)


def _bad_line(number: int, reason: str) -> APIError:
    return bad_request(f"line {number}: {reason}", param="file", code="invalid_batch_line")


def file_too_large(max_file_bytes: int) -> APIError:
    return APIError(413, f"the file is larger than this server's limit of {max_file_bytes / 2**20:g} MiB "
                         f"(--batch-max-file-mb)", param="file", code="file_too_large")
