"""What a request may cost before it is refused: body size, content type, prompt length, output length.

Every check here runs before the body is parsed or tokenised, so a hostile body
costs at most `max_body_bytes` of reading.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from dlfp.server.errors import APIError, bad_request

@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int
    max_tokens_limit: int | None = None  # None: a request may ask for the whole remaining context
    bytes_per_token: int | None = None  # the most input bytes one token can cover (Backend.max_token_bytes)

    def min_tokens(self, n_bytes: int) -> int:
        """A lower bound on the tokens `n_bytes` of text become (0 when no bound is known)."""
        if not self.bytes_per_token:
            return 0
        return -(-n_bytes // self.bytes_per_token)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 415 unless it is JSON and with 413 past `limit` bytes,
    before more than `limit` bytes are read (the Content-Length, when sent, is checked first)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"the body must be sent as Content-Type: application/json, got {media or 'none'!r}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit / 2**20:g} MiB "
                         f"(--max-body-mb)", code="request_too_large")


def check_text_fits(limits: RequestLimits, n_bytes: int, context: int, param: str) -> None:
    """Refuse text that cannot fit the context, from its length alone (before tokenising it)."""
    at_least = limits.min_tokens(n_bytes)
    if at_least >= context:
        raise bad_request(f"the prompt has {n_bytes} bytes of text, so at least {at_least} tokens "
                          f"(one token covers at most {limits.bytes_per_token} bytes with this vocabulary); "
                          f"this server's context is {context} tokens per sequence",
                          param=param, code="context_length_exceeded")
