"""`dlfp serve` in process (the app on a tiny random-weight GGUF): what a request may
cost before it is refused, a dead engine seen by /health, and request validation
that keeps one request's settings from stopping the engine."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from tiny_gguf import CHATML, write_tiny_gguf  # noqa: E402

from dlfp.sim import SimBackend  # noqa: E402
from dlfp.cli import get_profile, open_backend  # noqa: E402
from dlfp.policy import Unbounded  # noqa: E402
from dlfp.engine import Engine, EngineConfig  # noqa: E402
from dlfp.sampling import sample  # noqa: E402
from dlfp.sequence import Request, SamplingParams  # noqa: E402
from dlfp.server.app import ServeOptions, ServerState, create_app  # noqa: E402

ORIGIN = "http://127.0.0.1"  # TestClient's default Host ("testserver") is not on the allow-list


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("guard") / "tiny-chat.gguf", vocab=512, chat_template=CHATML)
    be = open_backend("llamacpp", str(path), get_profile("cpu-laptop"), 1)
    yield be
    be.close()


def make_client(backend, **options) -> tuple[TestClient, ServerState]:
    engine = Engine(backend, Unbounded(), EngineConfig(preemption_budget_s=None))
    state = ServerState(engine, "tiny-chat", "unbounded", ServeOptions(**options))
    return TestClient(create_app(state), base_url=ORIGIN), state


def complete(c: TestClient, **body) -> dict:
    r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_negative_seeds_and_tiny_temperatures_fail_nothing(backend):
    c, _ = make_client(backend)
    with c:
        greedy = complete(c, temperature=0, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
        for seed in (-1, -2**63, 2**70):
            a = complete(c, seed=seed, temperature=1.0, ignore_eos=True, return_token_ids=True)
            b = complete(c, seed=seed, temperature=1.0, ignore_eos=True, return_token_ids=True)
            assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]  # a seed is reproducible
        tiny = complete(c, temperature=5e-324, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
        assert tiny == greedy  # near-greedy, not NaN
        assert c.get("/health").status_code == 200


def test_sampling_at_a_tiny_temperature_is_greedy_and_finite():
    logits = np.array([0.5, 3.0, -1.0, 2.9], dtype=np.float32)
    rng = np.random.default_rng(0)
    for t in (5e-324, 1e-300, 1e-30):
        assert {sample(logits, SamplingParams(t, 1.0), rng) for _ in range(20)} == {1}
        assert sample(logits, SamplingParams(t, 5e-324), rng) == 1


@pytest.mark.parametrize("bad", [{"temperature": float("nan")}, {"temperature": -1.0}, {"top_p": 0.0},
                                 {"top_p": float("inf")}, {"seed": 1.5}, {"seed": True}])
def test_sampling_params_refuse_what_the_sampler_cannot_use(bad):
    with pytest.raises(ValueError):
        SamplingParams(**({"temperature": 1.0} | bad))


def test_a_negative_seed_runs_in_the_engine():
    engine = Engine(SimBackend(), Unbounded(), EngineConfig(preemption_budget_s=None)).start()
    try:
        rec = engine.submit(Request([1, 2, 3], 4, sampling=SamplingParams(1.0, 1.0, -1))).result(timeout=10)
        assert rec.ok and len(rec.output_ids) == 4
        later = engine.submit(Request([1, 2, 3], 2)).result(timeout=10)
        assert later.ok
    finally:
        engine.shutdown()


@pytest.mark.parametrize("bad", [{"prompt_ids": [1, 2.5]}, {"prompt_ids": [1, True]}, {"request_id": 7},
                                 {"ignore_eos": "yes"}, {"sampling": {"seed": -1}}])
def test_request_validation_catches_what_would_break_the_loop(bad):
    req = Request(**({"prompt_ids": [1, 2], "max_tokens": 2} | bad))
    with pytest.raises(ValueError):
        req.validate(1000, 100)


def test_a_dead_engine_makes_health_and_requests_503(backend):
    c, state = make_client(backend)
    with c:
        complete(c)

        def broken() -> bool:
            raise RuntimeError("scheduler state corrupted")

        state.engine.scheduler.has_work = broken  # outside any step: the loop itself dies
        state.engine.abort("nothing")  # wake the loop
        for _ in range(100):
            if c.get("/health").status_code == 503:
                break
            time.sleep(0.02)
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed", h.text
        r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text


def test_a_stopped_engine_makes_health_503(backend):
    c, state = make_client(backend)
    with c:
        state.engine.shutdown()
        assert c.get("/health").status_code == 503
        assert c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 503


def test_prompt_past_the_context_is_refused_before_tokenising(backend, monkeypatch):
    c, state = make_client(backend)
    per_token = backend.max_token_bytes()
    context = backend.capabilities.context_per_sequence
    assert per_token is not None and per_token >= 4
    calls = []
    monkeypatch.setattr(backend, "tokenize", lambda *a, **k: calls.append(a) or [5, 6])
    monkeypatch.setattr(backend, "apply_chat_template", lambda *a, **k: calls.append(a) or [5, 6])
    text = "a" * (context * per_token)
    with c:
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert calls == []
        complete(c, prompt="a short prompt")  # short text is still tokenised
        assert calls


def test_the_length_bound_is_sound(backend):
    """The bound says n bytes become at least n / bytes_per_token tokens: check it on text
    made of the vocabulary's longest pieces, the worst case for it."""
    per_token = backend.max_token_bytes()
    pieces = sorted(range(backend.capabilities.vocab_size),
                    key=lambda t: -len(backend.token_bytes([t], special=True)))[:20]
    for t in pieces:
        text = backend.token_bytes([t], special=True).decode(errors="ignore") * 50
        assert len(backend.tokenize(text, add_special=False)) * per_token >= len(text.encode())


def test_body_limit_content_type_and_max_tokens_limit(backend):
    c, _ = make_client(backend, max_body_bytes=4096, max_tokens_limit=6)
    with c:
        r = c.post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit holds while the body streams in
            for _ in range(10):
                yield b" " * 1000

        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = c.post("/v1/completions", content=b'{"prompt": [5, 6]}', headers={"content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        out = complete(c, max_tokens=None, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == 6  # the limit is the default too


def test_metrics_count_what_the_client_saw(backend):
    c, state = make_client(backend)
    with c:
        body = {"prompt": [300, 301, 302], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        text = complete(c, **body)["choices"][0]["text"]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        assert stop
        cut = complete(c, **body, stop=[stop])
        assert cut["choices"][0]["finish_reason"] == "stop"
        with c.stream("POST", "/v1/completions", json=body | {"stop": [stop], "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        streamed = json.loads(lines[-1][6:])["usage"]["completion_tokens"]
        metrics = c.get("/metrics").text
    assert 'dlfp_requests_total{finish_reason="stop",priority="foreground"} 2.0' in metrics
    assert 'finish_reason="abort"' not in metrics, metrics
    sent = 12 + cut["usage"]["completion_tokens"] + streamed
    assert f'dlfp_generation_tokens_total{{priority="foreground"}} {float(sent)}' in metrics


@pytest.mark.parametrize("body,param", [
    ({"messages": ["x"]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": 5}, "stream_options"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 20}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": "z" * 1000}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": "7"}, "seed"),
    ({"prompt": [1, True], "max_tokens": 2}, "prompt"),
    ({"prompt": [1, -4], "max_tokens": 2}, "prompt"),
])
def test_bad_fields_are_named(backend, body, param):
    c, _ = make_client(backend)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        r = c.post(path, content=b'{"prompt": [5], "temperature": NaN}', headers={"content-type": "application/json"})
        assert r.status_code == 400
        complete(c)


def test_405_keeps_the_allow_header(backend):
    c, _ = make_client(backend)
    with c:
        r = c.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


def test_api_key_host_allow_list_and_cors(backend, monkeypatch):
    from dlfp.server.exposure import Exposure

    c, _ = make_client(backend, exposure=Exposure(api_key="s3cret", cors_origins=("http://app.example",)))
    ok = {"prompt": [5, 6], "max_tokens": 2}
    with c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.post("/v1/completions", json=ok, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/completions", json=ok, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200  # a supervisor needs no key
        r = c.post("/v1/completions", json=ok, headers={"Authorization": "Bearer s3cret", "Host": "evil.example"})
        assert r.status_code == 400  # DNS rebinding: a foreign name for this address
        pre = c.options("/v1/completions", headers={"Origin": "http://app.example",
                                                    "Access-Control-Request-Method": "POST"})
        assert pre.headers.get("access-control-allow-origin") == "http://app.example"
        pre = c.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                    "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers
    plain, _ = make_client(backend)
    with plain:
        pre = plain.options("/v1/completions", headers={"Origin": "http://app.example",
                                                        "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers  # CORS is off by default


def test_non_loopback_bind_allows_only_named_hosts():
    from dlfp.server.exposure import host_allow_list, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    assert "evil.example" not in host_allow_list("0.0.0.0", ())
    assert "box.lan" in host_allow_list("0.0.0.0", ("box.lan",))
    assert "192.168.1.5" in host_allow_list("192.168.1.5", ())


def test_no_request_is_left_behind_in_the_server(backend):
    c, state = make_client(backend)
    with c:
        for i in range(20):
            if i % 2:
                complete(c)
                continue
            with c.stream("POST", "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4, "stream": True}) as r:
                assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""] or r.status_code == 200
        assert state.bridge.in_flight == {}


WEIRD = [None, -1, 0, 1, 2**64, -(2**63) - 1, 5e-324, 1e308, -0.0, "", "x", "NaN", [], {}, [1], [[]], ["a"],
         [{"role": "user", "content": "hi"}], {"include_usage": True}, {"include_usage": "yes"}, True, False,
         [5, 6, 7], [{"type": "text", "text": "hi"}], [{"type": "image_url"}], "background", "\u0000\ud7ff"]
FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
          "stream_options", "n", "ignore_eos", "return_token_ids", "priority", "logprobs", "echo", "suffix", "tools"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_get_a_named_4xx_or_an_answer_and_the_engine_serves_on(backend, path):
    import random

    rng = random.Random(13)
    c, state = make_client(backend, max_tokens_limit=3)
    base = {"prompt": [5, 6]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with c:
        for _ in range(120):
            body = dict(base)
            for field in rng.sample(FIELDS, rng.randint(1, 4)):
                body[field] = rng.choice(WEIRD)
            if rng.random() < 0.3:  # the prompt or the messages themselves
                key = next(iter(base))
                body[key] = rng.choice(WEIRD)
            if body.get("model") is not None:
                del body["model"]  # a wrong model name is a 404 (tested elsewhere), which hides the rest
            r = c.post(path, json=body)
            assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
            if r.status_code != 200:
                err = r.json()["error"]
                assert err["message"], body
                assert err["param"] is not None or "JSON object" in err["message"] or "vocabulary" in err["message"] \
                    or "empty" in err["message"], (body, err)
        assert c.get("/health").status_code == 200
        complete(c, max_tokens=2)
        assert state.bridge.in_flight == {}
