"""`dlfp serve` for real: a subprocess on loopback over a tiny random-weight GGUF,
driven by the official `openai` client, httpx, and the endpoint bench target."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai  # the official client: what a chat app would use
import pytest

pytest.importorskip("llama_cpp")

from tiny_gguf import CHATML, write_tiny_gguf  # noqa: E402

from dlfp.bench.endpoint import EndpointTarget  # noqa: E402
from dlfp.sequence import BACKGROUND, FOREGROUND, Request  # noqa: E402
from dlfp.server.text import TextStream  # noqa: E402

SLOTS, MAX_QUEUE = 4, 2  # the cpu-laptop profile's n_seq_max; the queue limit the server gets
LONG = 2000  # tokens: seconds of decoding on this model, so a request is surely still running


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # Wider than the suite's tiny model so that a long request lasts seconds, not a fraction of one.
    path = tmp_path_factory.mktemp("server") / "tiny-chat.gguf"
    return write_tiny_gguf(path, vocab=512, n_embd=256, n_layer=4, n_ff=512, chat_template=CHATML)


class Server:
    def __init__(self, model: Path, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.root = f"http://127.0.0.1:{port}"
        self.base = self.root + "/v1"
        cmd = [sys.executable, "-m", "dlfp.cli", "serve", "--model", str(model), "--port", str(port),
               "--threads", "1", "--max-queue", str(MAX_QUEUE), *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.http = httpx.Client(base_url=self.root, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError("dlfp serve did not come up")

    def health(self) -> dict:
        return self.http.get("/health").json()

    def wait_idle(self, timeout: float = 20) -> dict:
        """Every request done and every sequence slot (KV cache) free again."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["in_flight"] == 0 and h["running"] == 0 and h["free_slots"] == SLOTS:
                return h
            assert time.monotonic() < deadline, f"requests or sequences leaked: {h}"
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        text = self.http.get("/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--policy", "dlfp")
    yield s
    s.stop()


def client(server: Server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.base, api_key="unused", timeout=60, max_retries=0)


CHAT = [{"role": "user", "content": "Tell me about the weather in Zürich."}]


def test_openai_client_chat_plain_and_streamed_agree(server):
    c = client(server)
    model = c.models.list().data[0]
    assert model.owned_by == "dlfp"
    extra = {"ignore_eos": True}
    plain = c.chat.completions.create(model=model.id, messages=CHAT, max_tokens=12, temperature=0, extra_body=extra,
                                      presence_penalty=0, response_format={"type": "text"})  # neutral: accepted
    assert plain.object == "chat.completion"
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12 and plain.usage.prompt_tokens > 5
    chunks = list(c.chat.completions.create(model=model.id, messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content  # greedy: streaming changes nothing
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_token_ids_and_stop_strings(server):
    body = {"prompt": list(range(300, 340)), "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = server.http.post("/v1/completions", json=body).json()["choices"][0]
    assert len(full["token_ids"]) == 16 and full["finish_reason"] == "length"
    text = full["text"]
    lines = []
    with server.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(chunks) == 16  # one chunk per token, the finish reason on the last
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == full["token_ids"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = server.http.post("/v1/completions", json=body | {"stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]


def test_text_stream_waits_for_whole_characters_and_stop_strings():
    class Bytes:  # a backend whose tokens are single bytes, as byte-fallback vocabularies have
        def token_bytes(self, ids):
            return bytes(ids)

    data = "née 日本 END tail".encode()
    ts = TextStream(Bytes(), stop=["END"])
    pieces = [ts.push(b) for b in data]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "née 日本 " and ts.stopped
    assert pieces[data.index("日".encode()) + 2] == "日"  # released on the character's last byte


BAD = [
    ("not json", b'{"prompt": [1, 2', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("wrong type", {"prompt": [5, 6], "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": [5, 6], "max_tokens": -3}, 400, "max_tokens"),
    ("huge max_tokens", {"prompt": [5, 6], "max_tokens": 10**9}, 400, "max_tokens"),
    ("prompt past the context", {"prompt": [5] * 3000, "max_tokens": 4}, 400, "prompt"),
    ("token outside the vocabulary", {"prompt": [5, 10**6], "max_tokens": 4}, 400, "prompt"),
    ("unknown model", {"prompt": [5, 6], "model": "gpt-9"}, 404, "model"),
    ("bad priority", {"prompt": [5, 6], "priority": "urgent"}, 400, "priority"),
    ("temperature out of range", {"prompt": [5, 6], "temperature": 7}, 400, "temperature"),
    ("n > 1", {"prompt": [5, 6], "n": 3}, 400, "n"),
    ("seed not an integer", {"prompt": [5, 6], "seed": 0.5}, 400, "seed"),
    ("stream_options not an object", {"prompt": [5, 6], "stream_options": 5}, 400, "stream_options"),
    ("too many stop strings", {"prompt": [5, 6], "stop": [str(i) for i in range(50)]}, 400, "stop"),
    ("boolean token id", {"prompt": [5, True], "max_tokens": 2}, 400, "prompt"),
    ("JSON mode", {"prompt": [5, 6], "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("a penalty", {"prompt": [5, 6], "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("a grammar", {"prompt": [5, 6], "grammar": "root ::= [0-9]+"}, 400, "grammar"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, name, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.http.post("/v1/completions", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = server.http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200


def test_one_request_cannot_stop_the_engine(server):
    """Issue 13: a negative seed (OpenAI allows them) raised inside the engine loop and
    stopped it for everyone; a tiny temperature gave a 500 instead of near-greedy text."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    greedy = server.http.post("/v1/completions", json=body | {"temperature": 0}).json()["choices"][0]["token_ids"]
    for seed in (-1, -(2**63)):
        r = server.http.post("/v1/completions", json=body | {"seed": seed, "temperature": 1.0})
        assert r.status_code == 200, r.text
    r = server.http.post("/v1/completions", json=body | {"temperature": 5e-324})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy, r.text
    r = server.http.post("/v1/chat/completions", json={"messages": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert server.http.get("/health").status_code == 200
    assert server.http.post("/v1/completions", json=body).status_code == 200


def test_not_json_and_method_not_allowed(server):
    r = server.http.post("/v1/completions", content=b'{"prompt": [5, 6]}', headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text  # a web page's no-preflight POST is refused
    r = server.http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers.get("allow") == "POST", r.headers


def test_api_key_from_the_environment_and_limits(model, monkeypatch):
    monkeypatch.setenv("DLFP_API_KEY", "k-123")
    s = Server(model, "--policy", "unbounded", "--max-body-mb", "0.01", "--max-tokens-limit", "5")
    try:
        r = s.http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        good = openai.OpenAI(base_url=s.base, api_key="k-123", max_retries=0)
        out = good.completions.create(model="tiny-chat", prompt=[5, 6, 7], extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5  # --max-tokens-limit is the default when none is asked
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base, api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.APIStatusError) as exc:
            good.completions.create(model="tiny-chat", prompt="x" * 20000, max_tokens=2)
        assert exc.value.status_code == 413
        with pytest.raises(openai.BadRequestError):
            good.completions.create(model="tiny-chat", prompt=[5, 6], max_tokens=6)
        r = s.http.get("/health")
        assert r.status_code == 200
        r = s.http.get("/health", headers={"Host": "rebound.example"})
        assert r.status_code == 400
    finally:
        s.stop()


def test_bad_chat_input(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-chat", messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=CHAT, max_tokens=4)
    server.wait_idle()


def test_foreground_chat_with_background_load(server):
    c = client(server)
    fg_before = server.metric('dlfp_time_to_first_token_seconds_count{priority="foreground"}')
    bg_before = server.metric('dlfp_time_to_first_token_seconds_count{priority="background"}')
    outcomes: dict[str, str] = {}

    def background(i: int) -> None:
        body = {"prompt": list(range(100 + i, 400 + i)), "max_tokens": 16, "ignore_eos": True}
        # Half name the class in the body, half in the header (dlfp's two ways).
        kw = {"json": body | {"priority": "background"}} if i % 2 else {"json": body, "headers": {"X-Priority": "background"}}
        r = server.http.post("/v1/completions", **kw)
        outcomes[f"bg{i}"] = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.text

    threads = [threading.Thread(target=background, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    stream = c.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=48, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    reasons = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
    for t in threads:
        t.join(60)
    assert reasons == ["length"]
    assert outcomes == {f"bg{i}": "length" for i in range(4)}
    assert server.metric('dlfp_time_to_first_token_seconds_count{priority="foreground"}') == fg_before + 1
    assert server.metric('dlfp_time_to_first_token_seconds_count{priority="background"}') == bg_before + 4
    assert server.metric("dlfp_prefill_tokens_total{priority=\"background\"}") >= 4 * 300
    server.wait_idle()


def test_full_queue_gets_429_and_disconnects_free_their_sequences(server):
    server.wait_idle()
    long = {"prompt": [7, 8, 9], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    streams = []
    try:
        for _ in range(SLOTS + MAX_QUEUE):
            cm = server.http.stream("POST", "/v1/completions", json=long)
            r = cm.__enter__()
            streams.append(cm)
            assert r.status_code == 200
        full = server.http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 10  # the engine admits a request at its next step, not at the 200
        while (h := server.health())["running"] < SLOTS and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h["running"] == SLOTS and h["in_flight"] == SLOTS + MAX_QUEUE
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)  # hang up mid-stream
    server.wait_idle(timeout=10)
    # A non-streaming request whose client gives up is freed too.
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=long | {"stream": False}, timeout=0.5)
    server.wait_idle(timeout=10)
    assert server.metric('dlfp_requests_total{finish_reason="abort",priority="foreground"}') >= SLOTS + MAX_QUEUE + 1


def test_endpoint_target_times_tokens_on_the_client(server):
    target = EndpointTarget(server.base, label="dlfp-serve")
    target.open("dlfp")
    assert target.send_priority and target.model == "tiny-chat"
    reqs = [Request(list(range(50, 90)), 8, FOREGROUND, ignore_eos=True, request_id="fg"),
            Request(list(range(60, 260)), 8, BACKGROUND, ignore_eos=True, request_id="bg"),
            Request([5, 6], 10**6, BACKGROUND, request_id="too-long")]
    handles = [target.submit(r) for r in reqs]
    records = {h.request_id: h.result(timeout=60) for h in handles}
    trace = target.close()
    assert sorted(r.request_id for r in trace.requests) == ["bg", "fg", "too-long"]
    # The server's steps of the trial come back on the client's clock, guarded ones with their decision.
    fg = records["fg"]
    assert trace.steps and all(trace.origin - 1 < s.t0 <= s.t1 < time.perf_counter() for s in trace.steps)
    beside_fg = [s for s in trace.steps if s.t1 > fg.token_times[0] - 0.05 and s.t0 < fg.token_times[-1]]
    assert any(s.guarded and s.rule is not None and s.margin is not None for s in beside_fg)
    assert sum(s.n_prefill_bg for s in trace.steps) >= 200  # "bg"'s whole prompt ran in the trial's steps
    for rid in ("fg", "bg"):
        rec = records[rid]
        assert rec.ok and rec.finish_reason == "length"
        assert len(rec.output_ids) == len(rec.token_times) == 8
        assert rec.arrival_s < rec.token_times[0] <= rec.token_times[-1] <= rec.finished_s
    ref = server.http.post("/v1/completions", json={"prompt": list(range(50, 90)), "max_tokens": 8,
                                                    "temperature": 0, "ignore_eos": True,
                                                    "return_token_ids": True}).json()
    assert records["fg"].output_ids == ref["choices"][0]["token_ids"]
    assert "HTTP 400" in records["too-long"].error
    server.wait_idle()


def test_steps_route_serves_the_kept_steps_since_a_wall_clock_time(server):
    server.http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    body = server.http.get("/steps", params={"since": time.time() - 60}).json()
    assert body["complete"] and body["data"]
    last = body["data"][-1]
    assert abs(last["t1"] - time.time()) < 30 and {"rule", "cap", "duration_s", "n_decode"} <= set(last)
    assert server.http.get("/steps", params={"since": time.time() + 60}).json()["data"] == []
    assert server.http.get("/steps", params={"since": "soon"}).status_code == 400


def test_endpoint_target_refuses_a_dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match="did not answer"):
        EndpointTarget(f"http://127.0.0.1:{port}").open("unbounded")


def test_sigterm_finishes_short_requests_and_aborts_long_ones(model):
    # A grace far above the short request (50 tokens) and far below the long one (2,000 tokens,
    # about 2 s of decoding on the tiny model on a quiet machine).
    s = Server(model, "--policy", "unbounded", "--shutdown-grace", "1")
    assert s.metric("dlfp_prefill_cap_tokens") != s.metric("dlfp_prefill_cap_tokens")  # NaN: no cap
    ends: dict[str, tuple[str, str]] = {}

    def run(name: str, n: int, started: threading.Event) -> None:
        body = {"prompt": [7, 8, 9], "max_tokens": n, "ignore_eos": True, "stream": True}
        with s.http.stream("POST", "/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
            started.set()
        last = json.loads(lines[-1][6:])
        ends[name] = (json.loads(lines[0][6:])["id"], "error" if "error" in last else "finished")

    started = {k: threading.Event() for k in ("short", "long")}
    threads = [threading.Thread(target=run, args=(k, n, started[k])) for k, n in (("short", 50), ("long", LONG))]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while s.health()["running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        # While draining, a new client is answered (not refused at TCP level): 503 and a draining /health.
        deadline = time.monotonic() + 5
        while "draining" not in s.http.get("/health").text and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(base_url=s.root, timeout=10) as fresh:
            health = fresh.get("/health")
            late = fresh.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        for t in threads:
            t.join(30)
        rc = s.proc.wait(30)
        log = s.proc.stderr.read()
    finally:
        s.stop()
    assert time.monotonic() - t0 < 15
    assert rc == 0, log  # a drain is a clean exit
    m = re.search(r"finished \d+: ([^;]*); aborted \d+: (.*)$", log, re.M)
    assert m, log
    finished, aborted = m.group(1).split(", "), m.group(2).split(", ")
    assert ends["short"] == (finished[0], "finished"), log
    assert ends["long"] == (aborted[0], "error"), log


def test_serve_refuses_a_bad_policy_in_one_line(model):
    r = subprocess.run([sys.executable, "-m", "dlfp.cli", "serve", "--model", str(model), "--policy", "fastest"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "fastest" in r.stderr
