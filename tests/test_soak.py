"""`dlfp soak`'s bookkeeping against a real `dlfp serve` on a tiny random-weight GGUF:
every kind of request once, then the client tally must reconcile with /metrics."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from tiny_gguf import CHATML, write_tiny_gguf  # noqa: E402

from dlfp.server.soak import BAD_BODIES, Client, ServerProcess, Tally, reconcile, rss_growth  # noqa: E402


def test_each_kind_of_request_reconciles_with_metrics(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny-chat.gguf", vocab=512, chat_template=CHATML)
    server = ServerProcess(["--model", str(model), "--threads", "1", "--policy", "dlfp"], api_key="k")
    tally = Tally()
    try:
        client = Client(server.base, tally, seed=1, docs=["word " * 400], api_key="k", bg_chars=300)
        for kind in ("chat_stream", "chat", "background", "stop_stream", "hang_up", "hang_up"):
            getattr(client, kind)()
        for i in range(len(BAD_BODIES)):
            client.bad(i)
        snapshot = server.metrics()
    finally:
        code = server.stop()
    assert tally.errors == [], tally.errors
    assert sum(tally.completed.values()) == 4 and tally.hung_up == 2 and tally.bad_ok == len(BAD_BODIES)
    checks = reconcile(tally, snapshot)
    assert all(c["ok"] for c in checks.values()), checks
    assert code == 0  # SIGTERM with nothing in flight: a clean drain


def test_reconcile_catches_a_miscount():
    tally = Tally()
    tally.completed["stop"] = 3
    tally.tokens = 30
    snapshot = {'dlfp_requests_total{finish_reason="stop",priority="foreground"}': 2.0,
                'dlfp_generation_tokens_total{priority="foreground"}': 30.0}
    checks = reconcile(tally, snapshot)
    assert not checks["finished_stop"]["ok"] and checks["tokens_sent"]["ok"]


def test_rss_growth_is_measured_after_the_warmup():
    samples = [(0.0, 100.0), (60.0, 150.0), (300.0, 200.0), (3600.0, 202.0)]
    growth = rss_growth(samples, 300.0)
    assert growth["from_mb"] == 200.0 and growth["percent"] == pytest.approx(1.0)
    assert rss_growth(samples[:1], 300.0)["percent"] is None
