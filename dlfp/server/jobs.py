"""A parsed request body to a Job the engine can run: the one path for the HTTP routes and the batch runner.

Every check a body gets (model name, prompt size before tokenising, chat template,
output length, sampling settings) happens here, so a batch request is refused for
exactly the reasons the same body sent to /v1 would be, with the same message.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from starlette.concurrency import run_in_threadpool

from dlfp.protocol import BackendError
from dlfp.server.completions import Job, make_job
from dlfp.server.errors import bad_request
from dlfp.server.limits import check_text_fits
from dlfp.server.schemas import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from dlfp.server.app import ServerState


async def chat_job(state: ServerState, body: ChatRequest, priority: str, request_id: str | None = None,
                   headers: Mapping[str, str] = MappingProxyType({})) -> Job:
    model = state.check_model(body.model)
    context = state.backend.capabilities.context_per_sequence
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    # Chat templates render every message's content, so the contents alone bound the prompt from below.
    check_text_fits(state.limits, sum(len(m["content"].encode()) for m in messages), context, "messages")
    try:
        ids = await run_in_threadpool(state.backend.apply_chat_template, messages)
    except BackendError as exc:
        raise bad_request(f"{exc}; send a plain prompt to /v1/completions instead", param="messages") from None
    except Exception as exc:  # the model's own Jinja template rejected these messages
        raise bad_request(f"the chat template failed on these messages: {exc}", param="messages") from None
    return make_job(state.backend, body, ids, priority, model, True, state.limits.max_tokens_limit, request_id,
                    headers)


async def completion_job(state: ServerState, body: CompletionRequest, priority: str,
                         request_id: str | None = None, headers: Mapping[str, str] = MappingProxyType({})) -> Job:
    model = state.check_model(body.model)
    text = _prompt_text(body.prompt)
    if text is not None:
        check_text_fits(state.limits, len(text.encode()), state.backend.capabilities.context_per_sequence, "prompt")
    ids = await run_in_threadpool(_prompt_ids, state.backend, body.prompt)
    return make_job(state.backend, body, ids, priority, model, False, state.limits.max_tokens_limit, request_id,
                    headers)


def _prompt_ids(backend, prompt) -> list[int]:
    if isinstance(prompt, str):
        return backend.tokenize(prompt, add_special=True)
    if all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if len(prompt) != 1:
        raise bad_request("batched prompts are not supported: send one prompt per request", param="prompt")
    return _prompt_ids(backend, prompt[0])


def _prompt_text(prompt) -> str | None:
    """The prompt's text when it is text (one string, or a list of exactly one)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None
