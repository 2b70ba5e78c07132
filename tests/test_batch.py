"""The Batch API in process (the app on a tiny random-weight GGUF), driven by the official
`openai` client through the app's own transport: the whole flow, the error file, cancel,
expiry, limits, two batches at once, background priority, /metrics, and the store's
exactly-once rules."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from dlfp.cli import get_profile, open_backend  # noqa: E402
from dlfp.policy import Unbounded  # noqa: E402
from dlfp.engine import Engine, EngineConfig  # noqa: E402
from dlfp.server.app import ServeOptions, ServerState, create_app  # noqa: E402
from dlfp.server.batch_input import BatchLimits, InputLine  # noqa: E402
from dlfp.server.batch_service import BatchOptions  # noqa: E402
from dlfp.server.batch_store import BatchStore, Usage  # noqa: E402
from dlfp.server.exposure import Exposure  # noqa: E402

ORIGIN = "http://127.0.0.1"
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def backend(tiny_gguf):
    be = open_backend("llamacpp", str(tiny_gguf), get_profile("cpu-laptop"), 1)
    yield be
    be.close()


class App:
    """One in-process server with its own state folder, and the official client on its transport."""

    def __init__(self, backend, folder: Path, limits: BatchLimits = BatchLimits(), api_key: str | None = None,
                 model: str = "tiny-chat"):
        engine = Engine(backend, Unbounded(), EngineConfig(preemption_budget_s=None))
        options = ServeOptions(batch=BatchOptions(folder, limits), exposure=Exposure(api_key))
        self.state = ServerState(engine, model, "unbounded", options)
        self.http = TestClient(create_app(self.state), base_url=ORIGIN)
        self.client = openai.OpenAI(base_url=ORIGIN + "/v1", api_key=api_key or "unused", http_client=self.http,
                                    max_retries=0)

    def __enter__(self) -> "App":
        self.http.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.http.__exit__(*exc)

    def upload(self, lines: list[dict]) -> str:
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        return self.client.files.create(file=("input.jsonl", data), purpose="batch").id

    def submit(self, lines: list[dict], url: str = CHAT_URL):
        return self.client.batches.create(input_file_id=self.upload(lines), endpoint=url, completion_window="24h")

    def wait(self, batch_id: str, until=lambda b: b.status in FINAL, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while True:
            b = self.client.batches.retrieve(batch_id)
            if until(b):
                return b
            assert time.monotonic() < deadline, f"batch stuck: {b}"
            time.sleep(0.05)

    def lines_of(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        return [json.loads(x) for x in self.client.files.content(file_id).text.splitlines()]

    def metric(self, name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", self.http.get("/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0


def chat_line(i: int, max_tokens: int = 6, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT_URL,
            "body": {"messages": [{"role": "user", "content": f"Question number {i}: why?"}],
                     "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | body}


def contents(out: list[dict]) -> dict[str, str]:
    return {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in out}


def test_the_official_client_runs_the_whole_flow(backend, tmp_path):
    lines = [chat_line(i) for i in range(7)]
    with App(backend, tmp_path) as app:
        c = app.client
        uploaded = c.files.create(file=("input.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                  purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes > 0 and uploaded.filename == "input.jsonl"
        assert c.files.retrieve(uploaded.id).id == uploaded.id
        assert [json.loads(x) for x in c.files.content(uploaded.id).text.splitlines()] == lines
        batch = c.batches.create(input_file_id=uploaded.id, endpoint=CHAT_URL, completion_window="24h",
                                 metadata={"job": "flow"})
        assert batch.status == "in_progress" and batch.request_counts.total == 7 and batch.metadata == {"job": "flow"}
        done = app.wait(batch.id)
        assert done.status == "completed" and done.error_file_id is None
        assert (done.request_counts.completed, done.request_counts.failed) == (7, 0)
        assert done.completed_at >= done.created_at and done.usage.output_tokens == 7 * 6
        out = app.lines_of(done.output_file_id)
        assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(7)]  # each once, in input order
        assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in out)
        # A batch answer is what the same body sent to /v1 answers (greedy), and it ran as background work.
        direct = c.chat.completions.create(model="tiny-chat", **{k: v for k, v in lines[3]["body"].items()
                                                                  if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True})
        assert contents(out)["req-3"] == direct.choices[0].message.content
        assert app.metric('dlfp_generation_tokens_total{priority="background"}') == 7 * 6
        assert app.metric('dlfp_generation_tokens_total{priority="foreground"}') == 6  # the direct one alone
        # Pagination, newest first.
        second = app.submit([chat_line(0)])
        app.wait(second.id)
        page = c.batches.list(limit=1)
        assert [b.id for b in page.data] == [second.id] and page.has_more
        assert [b.id for b in c.batches.list(limit=1, after=second.id).data] == [batch.id]
        assert [b.id for b in c.batches.list(limit=5)] == [second.id, batch.id]
        # Deleting the input file leaves the batch and its results alone.
        assert c.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(uploaded.id)
        assert len(app.lines_of(c.batches.retrieve(batch.id).output_file_id)) == 7


def test_failing_lines_go_to_the_error_file_and_the_rest_goes_on(backend, tmp_path):
    context = backend.capabilities.context_per_sequence
    lines = [chat_line(0), chat_line(1, messages="not a list"), chat_line(2), chat_line(3, stream=True),
             chat_line(4, max_tokens=context + 1), chat_line(5, model="another-model"), chat_line(6)]
    with App(backend, tmp_path) as app:
        done = app.wait(app.submit(lines).id)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 4)
        assert [x["custom_id"] for x in app.lines_of(done.output_file_id)] == ["req-0", "req-2", "req-6"]
        errors = {x["custom_id"]: x for x in app.lines_of(done.error_file_id)}
        assert list(errors) == ["req-1", "req-3", "req-4", "req-5"]
        for i, x in enumerate(errors.values()):
            line = int(x["custom_id"].split("-")[1]) + 1
            assert x["error"]["line"] == line and x["error"]["message"].startswith(f"line {line}: ")
        assert errors["req-1"]["error"]["param"] == "messages"
        assert "stream" in errors["req-3"]["error"]["message"]
        assert errors["req-4"]["error"]["code"] == "context_length_exceeded"
        assert errors["req-5"]["response"]["status_code"] == 404
        # A completions batch runs too: token-id prompts, and one past the context fails alone.
        plain = [{"custom_id": "a", "method": "POST", "url": COMPLETIONS_URL,
                  "body": {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}},
                 {"custom_id": "b", "method": "POST", "url": COMPLETIONS_URL,
                  "body": {"prompt": [5] * context, "max_tokens": 3}}]
        done = app.wait(app.submit(plain, COMPLETIONS_URL).id)
        assert [x["custom_id"] for x in app.lines_of(done.output_file_id)] == ["a"]
        assert app.lines_of(done.error_file_id)[0]["error"]["line"] == 2


@pytest.mark.parametrize("line, reason", [
    ('{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}', "not valid JSON"),
    ('{"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions", "body": {}}', "repeats line 1"),
    ('{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}', "method"),
    ('{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}', "url must be"),
    ('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}', "one endpoint"),
    ('{"custom_id": "", "method": "POST", "url": "/v1/chat/completions", "body": {}}', "custom_id"),
    ('{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": []}', "body must"),
    ('[1, 2]', "JSON object"),
])
def test_a_malformed_upload_is_refused_before_anything_is_stored(backend, tmp_path, line, reason):
    data = (json.dumps(chat_line(0)) + "\n" + line + "\n").encode()
    with App(backend, tmp_path) as app:
        with pytest.raises(openai.BadRequestError) as err:
            app.client.files.create(file=("input.jsonl", data), purpose="batch")
        assert "line 2" in err.value.message and reason in err.value.message
        assert app.client.files.list().data == []


def test_limits_give_a_clear_4xx(backend, tmp_path):
    limits = BatchLimits(max_file_bytes=2000, max_lines=3, max_active=1)
    with App(backend, tmp_path, limits) as app:
        c = app.client
        big = json.dumps(chat_line(0, messages=[{"role": "user", "content": "x" * 3000}])).encode()
        with pytest.raises(openai.APIStatusError) as err:
            c.files.create(file=("big.jsonl", big), purpose="batch")
        assert err.value.status_code == 413 and "--batch-max-file-mb" in err.value.message

        def chunks():  # no Content-Length: the limit holds while the body is read
            yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jsonl\"\r\n\r\n"
            for _ in range(200):
                yield b"x" * 1000
        r = app.http.post("/v1/files", content=chunks(), headers={"content-type": "multipart/form-data; boundary=b"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
        r = app.http.post("/v1/files", json={"purpose": "batch"})
        assert r.status_code == 415
        with pytest.raises(openai.BadRequestError, match="more than 3 requests"):
            app.upload([chat_line(i) for i in range(4)])
        with pytest.raises(openai.BadRequestError, match="purpose"):
            c.files.create(file=("x.jsonl", json.dumps(chat_line(0)).encode()), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError, match="no requests"):
            c.files.create(file=("x.jsonl", b"\n\n"), purpose="batch")
        file_id = app.upload([chat_line(0)])
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            c.batches.create(input_file_id=file_id, endpoint=COMPLETIONS_URL, completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            c.batches.create(input_file_id=file_id, endpoint=CHAT_URL, completion_window="soon")
        with pytest.raises(openai.NotFoundError):
            c.batches.create(input_file_id="file-nope", endpoint=CHAT_URL, completion_window="24h")
        assert c.files.list().data[0].id == file_id and len(c.files.list().data) == 1  # refused ones left nothing
        slow = app.submit([chat_line(i, max_tokens=1500) for i in range(3)])
        with pytest.raises(openai.RateLimitError, match="--batch-max-queued"):
            c.batches.create(input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h")
        c.batches.cancel(slow.id)
        app.wait(slow.id)
        assert app.wait(c.batches.create(input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h").id
                        ).status == "completed"
        latest = c.batches.list(limit=1).data[0]
        assert latest.status == "completed"
        with pytest.raises(openai.APIStatusError) as err:
            c.batches.cancel(latest.id)
        assert err.value.status_code == 409


def test_cancel_stops_new_requests_and_keeps_finished_ones(backend, tmp_path):
    lines = [chat_line(i, max_tokens=1200) for i in range(8)]
    with App(backend, tmp_path) as app:
        batch = app.submit(lines)
        app.wait(batch.id, until=lambda b: b.request_counts.completed >= 1)
        cancelling = app.client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = app.wait(batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        n = done.request_counts
        assert 1 <= n.completed < 8 and n.failed == 0
        out, errors = app.lines_of(done.output_file_id), app.lines_of(done.error_file_id)
        assert len(out) == n.completed and all(x["response"]["body"]["usage"]["completion_tokens"] == 1200 for x in out)
        assert {x["error"]["code"] for x in errors} == {"batch_cancelled"} and len(errors) == 8 - n.completed
        assert sorted(x["custom_id"] for x in out + errors) == sorted(x["custom_id"] for x in lines)
        assert app.client.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes
        time.sleep(0.2)
        h = app.http.get("/health").json()
        assert h["in_flight"] == 0 and h["running"] == 0 and h["batch"]["in_flight"] == 0


def test_an_expired_batch_keeps_what_ran_and_reports_the_rest(backend, tmp_path):
    with App(backend, tmp_path) as app:
        batch = app.submit([chat_line(i, max_tokens=1200) for i in range(8)])
        app.wait(batch.id, until=lambda b: b.request_counts.completed >= 1)
        store = app.state.batch.store.store
        store.clock = lambda: time.time() + 25 * 3600  # past the 24 h window
        done = app.wait(batch.id)
        assert done.status == "expired" and done.expired_at is not None
        errors = app.lines_of(done.error_file_id)
        assert errors and {x["error"]["code"] for x in errors} == {"batch_expired"}
        assert len(errors) + done.request_counts.completed == 8


def test_two_batches_at_once_each_get_their_own_answers_once(backend, tmp_path):
    with App(backend, tmp_path) as app:
        first = app.submit([chat_line(i) for i in range(6)])
        second = app.submit([chat_line(i, max_tokens=4) for i in range(10, 15)])
        a, b = app.wait(first.id), app.wait(second.id)
        assert (a.status, b.status) == ("completed", "completed")
        out_a, out_b = app.lines_of(a.output_file_id), app.lines_of(b.output_file_id)
        assert [x["custom_id"] for x in out_a] == [f"req-{i}" for i in range(6)]
        assert [x["custom_id"] for x in out_b] == [f"req-{i}" for i in range(10, 15)]
        assert {x["response"]["body"]["usage"]["completion_tokens"] for x in out_b} == {4}
        assert a.output_file_id != b.output_file_id
        assert app.metric('dlfp_batches{status="completed"}') == 2
        assert app.metric('dlfp_batch_requests{state="done"}') == 11
        assert app.metric('dlfp_batch_requests{state="queued"}') == 0
        assert app.metric("dlfp_batch_journal_bytes") > 0


def test_a_stopped_server_resumes_only_batches_of_its_own_model(backend, tmp_path):
    with App(backend, tmp_path) as app:
        batch = app.submit([chat_line(i, max_tokens=1000) for i in range(12)])
        app.wait(batch.id, until=lambda b: b.request_counts.completed >= 1)
    with App(backend, tmp_path, model="another-model") as other:
        before = other.client.batches.retrieve(batch.id)
        assert before.status == "in_progress" and before.model == "tiny-chat" and before.request_counts.completed < 12
        time.sleep(0.5)
        assert other.client.batches.retrieve(batch.id).request_counts == before.request_counts  # left alone
        assert other.http.get("/health").json()["batch"]["in_flight"] == 0
    with App(backend, tmp_path) as again:
        done = again.wait(batch.id)
        assert done.status == "completed" and done.request_counts.completed == 12
        assert [x["custom_id"] for x in again.lines_of(done.output_file_id)] == [f"req-{i}" for i in range(12)]


def test_api_key_guards_every_batch_route(backend, tmp_path):
    with App(backend, tmp_path, api_key="s3cret") as app:
        for method, path in (("POST", "/v1/files"), ("GET", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content"),
                             ("DELETE", "/v1/files/file-x"), ("POST", "/v1/batches"), ("GET", "/v1/batches"),
                             ("GET", "/v1/batches/batch_x"), ("POST", "/v1/batches/batch_x/cancel")):
            r = app.http.request(method, path)
            assert r.status_code == 401, (method, path, r.status_code)
        assert app.wait(app.submit([chat_line(0)]).id).status == "completed"  # the client sends the key


def test_one_server_per_state_folder(backend, tmp_path):
    with App(backend, tmp_path) as first:
        second = App(backend, tmp_path)
        with second:
            r = second.http.get("/v1/batches")
            assert r.status_code == 503 and "in use by another dlfp serve" in r.json()["error"]["message"]
            assert second.http.get("/health").status_code == 200  # the chat API still serves
        assert first.http.get("/v1/batches").status_code == 200
    with App(backend, tmp_path) as again:  # released when the first server stopped
        assert again.http.get("/v1/batches").status_code == 200


def test_without_a_state_dir_the_batch_routes_say_why(backend):
    engine = Engine(backend, Unbounded(), EngineConfig(preemption_budget_s=None))
    with TestClient(create_app(ServerState(engine, "tiny-chat", "unbounded")), base_url=ORIGIN) as c:
        r = c.post("/v1/batches", json={})
        assert r.status_code == 503 and "--state-dir" in r.json()["error"]["message"]


# -- the store alone: the exactly-once rules a crash relies on ---------------------------------

def store_lines(n: int) -> list[InputLine]:
    return [InputLine(i + 1, f"c{i}", CHAT_URL, {"messages": []}) for i in range(n)]


def test_a_result_is_recorded_once_and_survives_reopening(tmp_path):
    store = BatchStore(tmp_path)
    b = store.create_batch("file-x", "m", CHAT_URL, "24h", 86400, None, store_lines(3), max_active=4)
    assert store.finish(b["id"], 2, True, '{"custom_id": "c1"}', Usage(5, 1, 3))
    assert not store.finish(b["id"], 2, True, '{"custom_id": "c1"}', Usage(5, 1, 3))  # a second finish: nothing
    store.close()
    store = BatchStore(tmp_path)  # as after a kill: what was committed is there, the rest is queued
    assert store.active_batches() == [(b["id"], "m", "in_progress", b["expires_at"])]
    assert store.queued_lines(b["id"]) == [1, 3]
    got = store.get_batch(b["id"])
    assert got["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert got["usage"]["output_tokens"] == 3 and got["usage"]["input_tokens_details"]["cached_tokens"] == 1
    for line in (1, 3):
        assert store.finish(b["id"], line, line == 1, json.dumps({"custom_id": f"c{line - 1}"}))
    done = store.finalize(b["id"], "completed")
    assert done["status"] == "completed" and store.finalize(b["id"], "cancelled")["status"] == "completed"
    assert store.file_content(done["output_file_id"]).decode().count("\n") == 2
    assert store.file_content(done["error_file_id"]).decode().count("\n") == 1
    assert len(store.list_files("batch_output")) == 2  # finalizing twice wrote no second set of files
    assert store.stats()["requests"] == {"done": 2, "failed": 1, "queued": 0}
    assert store.create_batch("file-x", "m", CHAT_URL, "24h", 86400, None, store_lines(1), max_active=1) is not None
    assert store.create_batch("file-x", "m", CHAT_URL, "24h", 86400, None, store_lines(1), max_active=1) is None
