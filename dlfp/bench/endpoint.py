"""A benchmark target for any OpenAI-compatible server (dlfp serve, llama.cpp's
server, vLLM, Ollama): the same workloads, timed on the client.

Each request streams from /v1/completions with its exact prompt token ids,
`ignore_eos` (a vLLM extension most servers accept) and greedy sampling, and is
timed as `vllm bench serve` times it: TTFT when the first token's chunk arrives,
one ITL per further token chunk. A chunk is a token only when it carries text or
token ids: llama.cpp's server (like OpenAI's API) ends a stream with a chunk that
carries the finish reason and empty text. The `priority` class is sent only to a
server that takes it (one whose /v1/models says `owned_by: dlfp`), since vLLM
reads an integer there and others may refuse the field.

Token ids: dlfp returns them with `return_token_ids`; llama.cpp's server with
`verbose` (each chunk's `__verbose.tokens`), which a multi-turn session needs to
build its next prompt from the reply. A request with `cache_prompt=False` sends
llama.cpp's `"cache_prompt": false`; the prompt tokens a server reused come back
in `usage.prompt_tokens_details.cached_tokens` (OpenAI's field) where it says.

Steps: a dlfp server's own, read from its `/steps` after the trial (each with its
decision record), aligned by the wall clock; other servers' steps are not visible.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from dlfp.sequence import Request
from dlfp.trace import RequestRecord, Trace, step_from_row

DLFP_OWNER = "dlfp"
LLAMACPP_OWNER = "llamacpp"  # llama.cpp's server in /v1/models
UNKNOWN_TOKEN = -1  # the server did not say which token it sent (only how many)


class EndpointHandle:
    def __init__(self, request_id: str, future: Future):
        self.request_id = request_id
        self._future = future

    def result(self, timeout: float | None = None) -> RequestRecord:
        return self._future.result(timeout)


class EndpointTarget:
    """RunTarget over HTTP. `base_url` is the API root, e.g. http://127.0.0.1:8000/v1."""

    def __init__(self, base_url: str, model: str | None = None, label: str = "endpoint",
                 send_priority: bool | None = None, timeout_s: float = 600.0, max_concurrency: int = 64):
        self.base_url = _api_root(base_url)
        self.model = model
        self.label = label
        self.send_priority = send_priority
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.policy: str | None = None
        self.server: dict = {}
        self.is_dlfp = False  # set by _probe: the server is dlfp serve
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._trace: Trace | None = None
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def open(self, policy: str) -> None:
        """`policy` is whatever the server was started with: recorded, not applied."""
        self.policy = policy
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        self._client = httpx.Client(base_url=self.base_url, limits=limits,
                                    timeout=httpx.Timeout(self.timeout_s, connect=10.0))
        self._probe()  # again: the server may have been restarted under another policy
        self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix=f"dlfp-{self.label}")
        self._trace = Trace(origin=time.perf_counter())
        self._opened_unix = time.time()
        self._futures = []

    def submit(self, request: Request) -> EndpointHandle:
        assert self._pool is not None, "open() first"
        arrival = time.perf_counter()
        future = self._pool.submit(self._run, request, arrival)
        with self._lock:
            self._futures.append(future)
        return EndpointHandle(request.request_id, future)

    def close(self) -> Trace:
        assert self._pool is not None and self._trace is not None, "open() first"
        self._pool.shutdown(wait=True)
        if self.is_dlfp:
            self._fetch_steps(self._trace)
        self._client.close()
        trace, self._trace, self._pool, self._client = self._trace, None, None, None
        return trace

    def _fetch_steps(self, trace: Trace) -> None:
        """A dlfp server's steps since open(), each with its decision record, on this trace's
        clock (aligned by the wall clock: the same host, or hosts whose clocks agree)."""
        root = self.base_url.removesuffix("/v1")
        try:
            r = self._client.get(f"{root}/steps", params={"since": self._opened_unix})
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            trace.note(f"the server's steps could not be read ({exc}): no step figures")
            return
        unix_origin = self._opened_unix - trace.origin  # Unix time of this trace's clock reading 0
        for row in body.get("data", []):
            trace.add_step(step_from_row(row, unix_origin))
        if not body.get("complete", True):
            trace.note("the server had dropped some of the trial's steps (it keeps its latest few thousand)")

    def describe(self) -> dict:
        if not self.server:
            self._probe()
        return {"name": "endpoint", "label": self.label, "base_url": self.base_url, "model": self.model,
                "server_policy": self.policy, "send_priority": self.send_priority, "server": self.server,
                "vocab_size": self.server.get("vocab_size"),
                "timing": "client: chunk arrival times (vllm bench serve definitions)",
                "steps": "the server's, from /steps" if self.is_dlfp else None}

    # -- internals ---------------------------------------------------------
    def _probe(self) -> None:
        try:
            r = httpx.get(f"{self.base_url}/models", timeout=10.0)
            r.raise_for_status()
            cards = r.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise ValueError(f"{self.base_url}/models did not answer as an OpenAI-compatible server: {exc}") from None
        if not cards:
            raise ValueError(f"{self.base_url}/models lists no model")
        ids = [c.get("id") for c in cards]
        if self.model is None:
            self.model = ids[0]
        elif self.model not in ids:
            raise ValueError(f"model {self.model!r} is not served at {self.base_url} (it has {ids})")
        card = cards[ids.index(self.model)]
        self.server = {k: card.get(k) for k in ("owned_by", "max_model_len", "vocab_size", "policy")}
        self.is_dlfp = card.get("owned_by") == DLFP_OWNER  # it takes dlfp's fields and serves /steps
        if self.send_priority is None:
            self.send_priority = self.is_dlfp
        self._token_ids = self.is_dlfp  # dlfp (like recent vLLM) returns token ids on request
        self._verbose_ids = card.get("owned_by") == LLAMACPP_OWNER

    def _body(self, request: Request) -> dict:
        body = {"model": self.model, "prompt": request.prompt_ids, "max_tokens": request.max_tokens,
                "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
                "ignore_eos": request.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        if request.sampling.seed is not None:
            body["seed"] = request.sampling.seed
        if self.send_priority:  # dlfp's request extensions: the class and a foreground request's own goals
            body["priority"] = request.priority
            if request.itl_target_s is not None:
                body["itl_target_ms"] = request.itl_target_s * 1e3
            if request.ttft_goal_s is not None:
                body["ttft_goal_ms"] = request.ttft_goal_s * 1e3
        if self._token_ids:
            body["return_token_ids"] = True
        if self._verbose_ids:
            body["verbose"] = True
        if not request.cache_prompt:
            body["cache_prompt"] = False
        return body

    def _run(self, request: Request, arrival: float) -> RequestRecord:
        got = _Stream()
        try:
            with self._client.stream("POST", "/completions", json=self._body(request)) as r:
                if r.status_code != 200:
                    r.read()
                    got.error = f"HTTP {r.status_code}: {_error_message(r)}"
                else:
                    got.read(r.iter_lines())
        except httpx.HTTPError as exc:
            got.error = f"{type(exc).__name__}: {exc}"
        record = got.record(request, arrival)
        self._trace.add_request(record)
        return record


class _Stream:
    """What one SSE response carried, timed as each chunk arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.ids: list[int] = []
        self.usage_tokens: int | None = None
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    def read(self, lines) -> None:
        for line in lines:
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data)
            except ValueError:
                self.error = f"the server sent a chunk that is not JSON: {data[:80]!r}"
                return
            if "error" in chunk:
                err = chunk["error"]
                self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                return
            if chunk.get("choices"):
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or _verbose_tokens(chunk, choice)
                if choice.get("text") or choice.get("delta", {}).get("content") or ids:
                    self.times.append(now)  # a token; a bare finish_reason chunk is not
                    self.ids.extend(ids)
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
            if chunk.get("usage"):
                usage = chunk["usage"]
                self.usage_tokens = usage.get("completion_tokens")
                self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if self.error is None and self.finish_reason is None:
            self.error = "the stream ended without a finish reason"

    def record(self, request: Request, arrival: float) -> RequestRecord:
        n_out = self.usage_tokens if self.usage_tokens is not None else len(self.times)
        ids = self.ids if len(self.ids) == n_out else [UNKNOWN_TOKEN] * n_out
        return RequestRecord(
            request_id=request.request_id, priority=request.priority, tag=request.tag, arrival_s=arrival,
            prompt_len=len(request.prompt_ids), output_ids=ids, token_times=list(self.times),
            finish_reason=self.finish_reason if self.error is None else "error", error=self.error,
            finished_s=time.perf_counter(), cached_prompt_tokens=self.cached_tokens,
            itl_target_s=request.itl_target_s, ttft_goal_s=request.ttft_goal_s,
        )


def _verbose_tokens(chunk: dict, choice: dict) -> list[int]:
    """llama.cpp's token ids of a streamed chunk (`verbose`); its final chunk repeats none."""
    if choice.get("finish_reason") is not None:
        return []
    verbose = chunk.get("__verbose")
    return list(verbose.get("tokens") or []) if isinstance(verbose, dict) else []


def _api_root(url: str) -> str:
    """Accept http://host:port (adds /v1) or the API root itself."""
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url + "/v1" if parts.path in ("", "/") else url


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json()["error"]
        return err["message"] if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
