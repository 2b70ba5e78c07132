"""`dlfp serve` reuses a conversation's prefix: usage.prompt_tokens_details.cached_tokens,
the `cache_prompt: false` opt-out, and /metrics' reused vs computed prompt tokens."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from tiny_gguf import CHATML, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model = write_tiny_gguf(tmp_path_factory.mktemp("srv") / "tiny.gguf", vocab=512, chat_template=CHATML)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dlfp.cli", "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--policy", "unbounded"], stderr=subprocess.DEVNULL)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "dlfp serve exited"
        try:
            if httpx.get(root + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "dlfp serve did not come up"
        time.sleep(0.1)
    yield root
    proc.terminate()
    proc.wait(20)


def complete(root, prompt, **extra):
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True} | extra
    r = httpx.post(root + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def metric(root, source):
    text = httpx.get(root + "/metrics").text
    m = re.search(rf'^dlfp_prompt_tokens_total{{priority="foreground",source="{source}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_cached_tokens_opt_out_and_metrics(base):
    prompt = [(11 + 37 * i) % 400 + 50 for i in range(80)]
    first = complete(base, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ids = first["choices"][0]["token_ids"]
    turn2 = prompt + ids + [60, 61, 62, 63]
    warm = complete(base, turn2)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + len(ids) - 1
    cold = complete(base, turn2, cache_prompt=False)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["token_ids"] == warm["choices"][0]["token_ids"]  # reuse changes no token
    reused, computed = metric(base, "reused"), metric(base, "computed")
    assert reused == len(prompt) + len(ids) - 1
    assert computed == len(prompt) + (len(turn2) - reused) + len(turn2)
    # Streamed: the usage chunk says the same.
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "prompt": turn2, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    usage = [__import__("json").loads(ln[6:]).get("usage") for ln in lines]
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == len(turn2) - 1
