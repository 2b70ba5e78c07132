"""A real `dlfp serve` killed with SIGKILL in the middle of a batch, restarted on the same state
folder: the batch resumes by itself, every custom_id is answered exactly once, and the
answers equal those of the same requests sent uninterrupted. Also `dlfp batch` end to end
(submit a folder, follow across the restart, status, cancel, results) with an API key."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")

from tiny_gguf import CHATML, write_tiny_gguf  # noqa: E402

from dlfp.batch_cli import DEFAULT_PROMPT, folder_requests  # noqa: E402
from dlfp.cli import UserError  # noqa: E402

KEY = "batch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKENS = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # Wider than the suite's tiny model, so a batch takes seconds and a kill lands in its middle.
    path = tmp_path_factory.mktemp("batch-resume") / "tiny-chat.gguf"
    return write_tiny_gguf(path, vocab=512, n_embd=256, n_layer=4, n_ff=512, chat_template=CHATML)


@pytest.fixture
def docs(tmp_path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(14):
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}. " + "The river carries silt to the sea. " * (3 + i % 4))
    (folder / "picture.png").write_bytes(b"\x89PNG not text")  # skipped: not a text file
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`dlfp serve` as a subprocess on a fixed port and state folder (a restart reuses both)."""

    def __init__(self, model: Path, port: int, state: Path):
        self.root = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "dlfp.cli", "serve", "--model", str(model), "--port", str(port),
               "--threads", "1", "--policy", "dlfp", "--state-dir", str(state), "--api-key", KEY]
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.http = httpx.Client(base_url=self.root, timeout=30, headers=AUTH)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if self.http.get("/health").status_code == 200:
                    self.t_healthy = time.monotonic()
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError("dlfp serve did not come up")

    def batch(self, batch_id: str) -> dict:
        return self.http.get(f"/v1/batches/{batch_id}").json()

    def kill9(self) -> None:
        self.http.close()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stderr.close()

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.proc.stderr.close()


def dlfp_batch(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dlfp.cli", "batch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlfp.cli", "batch", *args], capture_output=True, text=True,
                          timeout=60)


def test_a_killed_server_resumes_its_batch_and_loses_nothing(model, docs, tmp_path):
    port, state = free_port(), tmp_path / "state"
    server = Serve(model, port, state)
    try:
        bodies = {x["custom_id"]: x["body"] for x in folder_requests(docs, DEFAULT_PROMPT, TOKENS)}
        assert len(bodies) == 14  # the .png was skipped
        reference = {}
        for custom_id, body in bodies.items():  # the same requests, uninterrupted, one by one, as background work
            r = server.http.post("/v1/chat/completions", json=body, headers={"X-Priority": "background"})
            reference[custom_id] = r.json()["choices"][0]["message"]["content"]
        follower = dlfp_batch("submit", str(docs), "--server", server.root, "--api-key", KEY,
                              "--max-tokens", str(TOKENS))
        batch_id = follower.stdout.readline().strip()
        assert batch_id.startswith("batch_"), follower.stderr.read()
        deadline = time.monotonic() + 60
        while (b := server.batch(batch_id))["request_counts"]["completed"] < 3:
            assert time.monotonic() < deadline, b
            time.sleep(0.02)
        server.kill9()
        at_kill = b["request_counts"]["completed"]
        assert b["status"] == "in_progress" and at_kill < 14, "the kill must land in the middle of the batch"

        server = Serve(model, port, state)  # the same folder: the batch resumes by itself
        assert server.t_healthy - server.t_start < 30
        health = server.http.get("/health").json()
        assert health["status"] == "ok"
        assert follower.wait(120) == 0, follower.stderr.read()  # the follower waited through the restart
        done = server.batch(batch_id)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": 14, "completed": 14, "failed": 0}
        assert server.http.get("/health").json()["batch"]["resumed"]

        out = tmp_path / "answers.jsonl"
        r = run_cli("results", batch_id, "--out", str(out), "--server", server.root, "--api-key", KEY)
        assert r.returncode == 0, r.stderr
        answers = [json.loads(x) for x in out.read_text().splitlines()]
        ids = [x["custom_id"] for x in answers]
        assert ids == sorted(bodies)  # every custom_id exactly once, in input order
        got = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in answers}
        assert got == reference  # greedy answers equal the uninterrupted ones
        assert not (tmp_path / "answers.errors.jsonl").exists()
        metrics = server.http.get("/metrics").text
        assert 'dlfp_batches{status="completed"} 1.0' in metrics
        assert 'dlfp_batch_requests{state="done"} 14.0' in metrics
    finally:
        server.stop()


def test_the_cli_submits_follows_cancels_and_needs_the_key(model, docs, tmp_path):
    server = Serve(model, free_port(), tmp_path / "state")
    try:
        key = ["--server", server.root, "--api-key", KEY]
        r = run_cli("submit", str(docs), "--no-wait", "--max-tokens", "1500", "--server", server.root)
        assert r.returncode != 0 and "401" in r.stderr  # no key: refused, one line, no traceback
        assert "Traceback" not in r.stderr
        r = run_cli("submit", str(docs), "--no-wait", "--max-tokens", "1500", *key)
        assert r.returncode == 0, r.stderr
        batch_id = r.stdout.strip()
        status = run_cli("status", batch_id, *key)
        assert status.returncode == 0 and batch_id in status.stdout and "in_progress" in status.stdout
        early = run_cli("results", batch_id, "--out", str(tmp_path / "x.jsonl"), *key)
        assert early.returncode != 0 and "in_progress" in early.stderr
        deadline = time.monotonic() + 60
        while server.batch(batch_id)["request_counts"]["completed"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancel = run_cli("cancel", batch_id, *key)
        assert cancel.returncode == 0, cancel.stderr
        while (b := server.batch(batch_id))["status"] != "cancelled":
            assert time.monotonic() < deadline, b
            time.sleep(0.05)
        n = b["request_counts"]["completed"]
        assert 1 <= n < 14
        out = tmp_path / "partial.jsonl"
        r = run_cli("results", batch_id, "--out", str(out), *key)
        assert r.returncode == 0, r.stderr
        assert len(out.read_text().splitlines()) == n
        errors = [json.loads(x) for x in (tmp_path / "partial.errors.jsonl").read_text().splitlines()]
        assert len(errors) == 14 - n and {x["error"]["code"] for x in errors} == {"batch_cancelled"}
        listing = run_cli("list", *key)
        assert batch_id in listing.stdout and "cancelled" in listing.stdout
    finally:
        server.stop()


def test_folder_requests_take_text_files_and_need_the_placeholder(docs, tmp_path):
    lines = folder_requests(docs, "Summarize: {text}", 7)
    assert [x["custom_id"] for x in lines] == [f"doc{i:02d}.txt" for i in range(14)]
    first = lines[0]["body"]
    assert first["max_tokens"] == 7 and first["temperature"] == 0
    assert first["messages"][0]["content"] == "Summarize: " + (docs / "doc00.txt").read_text()
    with pytest.raises(UserError, match="{text}"):
        folder_requests(docs, "Summarize this", 7)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no text files"):
        folder_requests(tmp_path / "empty", DEFAULT_PROMPT, 7)
