"""Request bodies of the OpenAI API that dlfp serves, validated strictly.

Unknown fields are accepted and ignored (clients send many), but a known field
of the wrong type is a 400 naming that field, and so is a field that asks for output
dlfp does not produce (JSON mode, penalties, a grammar): a client relying on it would
otherwise get unconstrained text with a 200. vLLM's extensions that benchmarks
rely on are understood: `ignore_eos`, `return_token_ids`, an integer `priority`;
dlfp's own: `itl_target_ms` and `ttft_goal_ms`, a foreground request's goals.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlfp.server.errors import APIError, bad_request


MAX_STOPS, MAX_STOP_CHARS = 8, 256  # each token is checked against every stop string: bound the work
# Fields of the OpenAI API and of llama.cpp's and vLLM's servers that change which tokens come
# back, with the values that leave them as dlfp samples (anything else: a 400 naming the field).
OUTPUT_FIELDS = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "top_logprobs": (None, 0), "best_of": (None, 1), "functions": (None, []),
    "grammar": (None, ""), "json_schema": (None, {}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,),
}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(BaseModel):
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOPS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_prompt: bool = True  # llama.cpp's field: false prefills the whole prompt (no prefix reuse)
    # dlfp's class name, or vLLM's integer priority (lower runs first: <= 0 is foreground).
    priority: Literal["foreground", "background"] | int | None = None
    # dlfp's per-request goals for a foreground request, in ms (None: the server profile's).
    itl_target_ms: float | None = Field(default=None, gt=0)
    ttft_goal_ms: float | None = Field(default=None, gt=0)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_stop(self) -> None:
        long = next((s for s in self.stop_list() if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise bad_request(f"stop strings may have at most {MAX_STOP_CHARS} characters, got {len(long)}",
                              param="stop")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> str | None:
        """The name of a requested feature dlfp does not have (a 400), or None."""
        extra = self.model_extra or {}
        fmt = extra.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
            return "response_format"
        return next((name for name, neutral in OUTPUT_FIELDS.items()
                     if name in extra and extra[name] not in neutral), None)


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal[ROLES]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        return "tools" if self.tools else super().unsupported()


class CompletionRequest(_Common):
    # A string, token ids, or a one-element list of either (`vllm bench serve` sends ids).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs"
        if self.echo:
            return "echo"
        return "suffix" if self.suffix else super().unsupported()


def parse(model: type[_Common], raw: bytes) -> _Common:
    """Validate a JSON body; any problem becomes a 400 naming the offending field."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        if not err["loc"]:
            raise bad_request("the body must be a JSON object") from None
        param = str(err["loc"][0])  # the top-level field (deeper parts name union members too)
        where = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or p == err["loc"][0])
        raise bad_request(f"{where}: {err['msg']}", param=param) from None
    body.check_stop()
    if body.n != 1:
        raise bad_request("only n=1 is supported", param="n")
    what = body.unsupported()
    if what:
        raise bad_request(f"{what} is not supported by dlfp serve", param=what)
    return body


def unknown_model(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
