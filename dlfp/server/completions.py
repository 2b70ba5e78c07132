"""/v1/completions and /v1/chat/completions: a parsed body in, an OpenAI response out."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
import math
from types import MappingProxyType
from typing import AsyncIterator, Mapping

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dlfp.protocol import Backend
from dlfp.engine import InvalidRequest, TokenEvent
from dlfp.sequence import BACKGROUND, FOREGROUND, PRIORITIES, Request, SamplingParams
from dlfp.server.bridge import EngineBridge, Submitted
from dlfp.server.errors import APIError, bad_request
from dlfp.server.schemas import _Common
from dlfp.server.text import TextStream

OPENAI_DEFAULT_TEMPERATURE = 1.0  # what the OpenAI API does when temperature is omitted


@dataclass
class Job:
    """One accepted request and how its answer is formatted."""

    chat: bool
    body: _Common
    backend: Backend
    model: str
    request: Request
    created: int
    cached_tokens: int = 0  # prompt tokens reused from a cached prefix (known when the request ends)

    @property
    def id(self) -> str:
        return self.request.request_id

    def is_last(self, token_id: int, n_out: int) -> bool:
        """Whether the engine will end the request on this token (max_tokens or EOS;
        make_job keeps prompt + max_tokens within the context)."""
        req = self.request
        return n_out >= req.max_tokens or (not req.ignore_eos and self.backend.is_eos(token_id))

    def chunk(self, text: str | None, token_ids: list[int] | None, finish_reason: str | None = None) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if self.body.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        out = self._envelope(".chunk" if self.chat else "", [choice])
        if self.body.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def role_chunk(self) -> dict:
        out = self.chunk(None, None)
        out["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return out

    def usage_chunk(self, n_out: int) -> dict:
        return self._envelope(".chunk" if self.chat else "", []) | {"usage": self.usage(n_out)}

    def final(self, text: str, token_ids: list[int], finish_reason: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        return self._envelope("", [choice]) | {"usage": self.usage(len(token_ids))}

    def usage(self, n_out: int) -> dict:
        n_in = len(self.request.prompt_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _envelope(self, suffix: str, choices: list[dict]) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + suffix
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def make_job(backend: Backend, body: _Common, prompt_ids: list[int], priority: str, model: str, chat: bool,
             max_tokens_limit: int | None = None, request_id: str | None = None,
             headers: Mapping[str, str] = MappingProxyType({})) -> Job:
    """Check the sizes and sampling settings; every problem is a 400 naming its field.
    `request_id`: the engine's id (default: a fresh one); it also seeds a request sent without a seed."""
    context = backend.capabilities.context_per_sequence
    n_in = len(prompt_ids)
    if n_in == 0:
        raise bad_request("the prompt is empty", param="messages" if chat else "prompt")
    if n_in >= context:
        raise bad_request(f"the prompt has {n_in} tokens; this server's context is {context} tokens per sequence",
                          param="messages" if chat else "prompt", code="context_length_exceeded")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    n_out = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if n_out is None:  # the remaining context, or the server's per-request limit when it is smaller
        n_out = context - n_in if max_tokens_limit is None else min(max_tokens_limit, context - n_in)
    if n_out < 1:
        raise bad_request(f"{param} must be at least 1, got {n_out}", param=param)
    if max_tokens_limit is not None and n_out > max_tokens_limit:
        raise bad_request(f"{param}={n_out} is more than this server allows per request ({max_tokens_limit}, "
                          f"--max-tokens-limit)", param=param)
    if n_in + n_out > context:
        raise bad_request(f"{param}={n_out} plus the prompt's {n_in} tokens exceeds the context of {context} "
                          f"tokens per sequence", param=param, code="context_length_exceeded")
    temperature = OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    try:
        sampling = SamplingParams(temperature, 1.0 if body.top_p is None else body.top_p, body.seed)
    except ValueError as exc:  # the schema checks the ranges: this is a backstop that names no field
        raise bad_request(str(exc)) from None
    goals = resolve_goals(body, headers, priority)
    prefix = "chatcmpl" if chat else "cmpl"
    request = Request(prompt_ids, n_out, priority, sampling, body.ignore_eos,
                      request_id=request_id or f"{prefix}-{uuid.uuid4().hex[:24]}", tag="http",
                      cache_prompt=body.cache_prompt, itl_target_s=goals[0], ttft_goal_s=goals[1])
    try:  # the engine checks again at submit; here the error comes before any 429 and names its field
        request.validate(backend.capabilities.vocab_size, context)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages" if chat else "prompt") from None
    return Job(chat, body, backend, model, request, int(time.time()))


def resolve_priority(body: _Common, header: str | None) -> str:
    value = body.priority if body.priority is not None else header
    if value is None:
        return FOREGROUND
    if isinstance(value, int):
        return FOREGROUND if value <= 0 else BACKGROUND  # vLLM: a lower value runs first
    name = value.strip().lower()
    if name not in PRIORITIES:
        raise bad_request(f"X-Priority must be one of {list(PRIORITIES)}, got {value!r}", param="priority")
    return name


GOAL_HEADERS = {"itl_target_ms": "x-itl-target-ms", "ttft_goal_ms": "x-ttft-goal-ms"}


def resolve_goals(body: _Common, headers: Mapping[str, str], priority: str) -> tuple[float | None, float | None]:
    """A foreground request's own (ITL target, TTFT goal) in seconds, from the body's
    `itl_target_ms` / `ttft_goal_ms` or the X-ITL-Target-Ms / X-TTFT-Goal-Ms headers (the body
    wins); None where neither names one (the engine's defaults)."""
    out = []
    for name, header in GOAL_HEADERS.items():
        value = getattr(body, name)
        if value is None and headers.get(header) is not None:
            try:
                value = float(headers[header])
            except ValueError:
                value = -1.0
            if not math.isfinite(value) or value <= 0:
                raise bad_request(f"{header}: a positive number of milliseconds, got {headers[header]!r}", param=name)
        if value is not None and priority != FOREGROUND:
            raise bad_request(f"{name} is a foreground request's goal; a {priority} request has none", param=name)
        out.append(None if value is None else value / 1e3)
    return out[0], out[1]


async def respond(bridge: EngineBridge, job: Job, http: HTTPRequest) -> Response:
    try:
        sub = bridge.submit(job.request)
    except InvalidRequest as exc:
        raise bad_request(str(exc)) from None
    text = TextStream(bridge.engine.backend, job.body.stop_list())
    if job.body.stream:
        return StreamingResponse(_stream(job, sub, text), media_type="text/event-stream",
                                 background=BackgroundTask(sub.cancel))
    return await _collect(job, sub, text, http)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(job: Job, sub: Submitted, text: TextStream) -> AsyncIterator[str]:
    """One chunk per token (empty text while a character is incomplete), the finish
    reason on the last token's chunk: the client's chunk times are token times, as
    `vllm bench serve` assumes."""
    n_out = 0
    try:
        if job.chat:
            yield _sse(job.role_chunk())
        while True:
            ev = await sub.next()
            piece, ids, end = "", None, ev
            if ev.token_id is not None:
                n_out += 1
                piece, ids = text.push(ev.token_id), [ev.token_id]
                end = _stopped(ev) if text.stopped else await sub.final(job.is_last(ev.token_id, n_out))
            # Counted as sent when handed to the server (before the yield, which a hang-up may interrupt).
            if end is None:
                sub.sent(1)
                yield _sse(job.chunk(piece, ids))
                continue
            reason, error = _outcome(end, job)
            if error is not None:
                if ids:
                    sub.sent(1)
                    yield _sse(job.chunk(piece, ids))
                sub.conclude(reason)
                yield _sse(error.body())
                break
            piece += text.flush()
            sub.sent(len(ids or ()))
            sub.conclude(reason)
            yield _sse(job.chunk(piece if (piece or ids) else None, ids, reason))
            if job.body.include_usage:
                yield _sse(job.usage_chunk(n_out))
            break
        yield "data: [DONE]\n\n"
    finally:
        sub.cancel()  # stopped early, or the client went away: free the sequence at the next step


async def collect(bridge: EngineBridge, job: Job, sub: Submitted) -> dict:
    """The whole answer of a submitted request (no HTTP client behind it: the batch runner).
    Raises APIError when the engine failed or aborted the request."""
    return await _gather(job, sub, TextStream(bridge.engine.backend, job.body.stop_list()))


async def _collect(job: Job, sub: Submitted, text: TextStream, http: HTTPRequest) -> Response:
    gather = asyncio.ensure_future(_gather(job, sub, text))
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gather.done():
            gather.cancel()
        sub.cancel()  # a no-op for a request that finished; frees one the client gave up on
    if not gather.done():
        return Response(status_code=499)  # nobody reads it: the client closed the connection
    return JSONResponse(gather.result())


async def _gather(job: Job, sub: Submitted, text: TextStream) -> dict:
    parts, ids = [], []
    while True:
        ev = await sub.next()
        if ev.token_id is not None:
            ids.append(ev.token_id)
            parts.append(text.push(ev.token_id))
            if not text.stopped:
                continue
            ev = _stopped(ev)
        reason, error = _outcome(ev, job)
        sub.conclude(reason)
        if error is not None:
            raise error
        parts.append(text.flush())
        sub.sent(len(ids))
        return job.final("".join(parts), ids, reason)


def _stopped(ev: TokenEvent) -> TokenEvent:
    """A stop string ended the text: the request is over for the client (we cancel it)."""
    return TokenEvent(ev.request_id, None, ev.t, "stop", cached_tokens=ev.cached_tokens)


async def _disconnected(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _outcome(ev: TokenEvent, job: Job | None = None) -> tuple[str, APIError | None]:
    if job is not None and ev.cached_tokens is not None:
        job.cached_tokens = ev.cached_tokens
    reason = ev.finish_reason or "error"
    if reason in ("stop", "length"):
        return reason, None
    if reason == "abort":
        return reason, APIError(503, "the request was aborted: the server is shutting down",
                                type="server_error", code="aborted")
    return reason, APIError(500, f"the engine failed this request: {ev.error}", type="server_error")
