"""`dlfp soak`: mixed traffic against a `dlfp serve` it starts, for minutes or hours.

Each client loops over a mix of requests (streamed and plain chat, background
document prompts, stop strings, seeded sampling, a client that hangs up, and
malformed bodies that must get a 4xx). The server's RSS is sampled throughout.
At the end the client's own tally is reconciled with the server's /metrics, the
server is sent SIGTERM (a drain must exit 0), and a results JSON is written.

Soak: `dlfp soak --minutes 60 --clients 2`. Load test: `dlfp soak --minutes 3
--clients 40 --max-queue 8` (429s are expected there and honoured with
Retry-After; what must hold is zero 5xx and every accepted request completed).
"""
from __future__ import annotations

import json
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import click

from dlfp.cli import UserError

SIGNATURE_OK = ("stop", "length")
QUESTIONS = [
    "What is a good way to start a compost heap?",
    "Explain in two sentences why bread rises.",
    "Name three parts of a bicycle.",
    "How does a lighthouse warn ships?",
    "Write one sentence about the printing press.",
]
# Malformed bodies and what the server must answer (the engine must keep serving after each).
BAD_BODIES = [
    ({"messages": ["x"]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": 5}, 400, "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, "temperature"),
    ({"prompt": [1, 2, 10**9], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
]


@dataclass
class Tally:
    """What the clients saw."""

    completed: Counter = field(default_factory=Counter)  # finish reason of 200s that ended normally
    tokens: int = 0  # completion tokens of completed requests (their usage)
    hung_up: int = 0  # streams this client closed on purpose
    hung_up_tokens: int = 0  # tokens those streams had received
    hung_up_max: int = 0  # the most tokens those streams could have been sent
    rejected_429: int = 0
    status_5xx: int = 0
    bad_ok: int = 0  # malformed bodies answered as expected
    errors: list[str] = field(default_factory=list)  # anything else: 5xx, wrong 4xx, broken streams
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what[:300])


class Client:
    def __init__(self, base: str, tally: Tally, seed: int, docs: list[str], api_key: str | None, bg_chars: int):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base, timeout=300, headers=headers)
        self.tally, self.rng, self.docs, self.bg_chars = tally, random.Random(seed), docs, bg_chars

    def run(self, until: float) -> None:
        kinds = ["chat_stream"] * 8 + ["chat"] * 4 + ["background"] * 4 + ["stop_stream"] * 2 + ["hang_up", "bad"]
        while time.monotonic() < until:
            kind = self.rng.choice(kinds)
            try:
                getattr(self, kind)()
            except Exception as exc:  # a transport failure is an error of the server under test
                self.tally.error(f"{kind}: {type(exc).__name__}: {exc}")
        self.http.close()

    def _chat_body(self, stream: bool) -> dict:
        body = {"messages": [{"role": "user", "content": self.rng.choice(QUESTIONS)}],
                "max_tokens": self.rng.randint(8, 40), "stream": stream,
                "temperature": self.rng.choice([0, 0.7, 1.0]), "seed": self.rng.randint(-2**40, 2**40)}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def chat_stream(self) -> None:
        self._stream("/v1/chat/completions", self._chat_body(True))

    def chat(self) -> None:
        body = self._chat_body(False) | {"stop": ["\n\n"]}
        self._plain("/v1/chat/completions", body)

    def background(self) -> None:
        doc = self.rng.choice(self.docs)
        start = self.rng.randint(0, max(0, len(doc) - self.bg_chars))
        body = {"prompt": f"Summarise:\n{doc[start:start + self.bg_chars]}\nSummary:", "max_tokens": 16,
                "temperature": 0, "priority": "background"}
        self._plain("/v1/completions", body)

    def stop_stream(self) -> None:
        body = {"prompt": self.rng.choice(QUESTIONS), "max_tokens": 32, "stream": True, "temperature": 0.8,
                "stop": [" the", "."], "stream_options": {"include_usage": True}}
        self._stream("/v1/completions", body)

    def hang_up(self) -> None:
        body = self._chat_body(True) | {"max_tokens": 64, "ignore_eos": True}
        keep = self.rng.randint(1, 5)
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if not self._accepted(r, "hang_up"):
                return
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {") and '"delta":{"content"' in line.replace(" ", ""):
                    got += 1
                if got >= keep:
                    break
        with self.tally.lock:  # the server may have sent more before it saw the hang-up
            self.tally.hung_up += 1
            self.tally.hung_up_tokens += got
            self.tally.hung_up_max += body["max_tokens"]

    def bad(self, which: int | None = None) -> None:
        body, status, param = self.rng.choice(BAD_BODIES) if which is None else BAD_BODIES[which]
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = self.http.post(path, json=body)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code == status and err.get("param") == param:
            with self.tally.lock:
                self.tally.bad_ok += 1
        else:
            self.tally.error(f"bad body {body}: expected {status} param={param}, got {r.status_code} {r.text}")

    def _accepted(self, r, kind: str) -> bool:
        if r.status_code == 200:
            return True
        r.read()
        if r.status_code == 429:
            with self.tally.lock:
                self.tally.rejected_429 += 1
            time.sleep(float(r.headers.get("retry-after", "1")))
        else:
            if r.status_code >= 500:
                with self.tally.lock:
                    self.tally.status_5xx += 1
            self.tally.error(f"{kind}: HTTP {r.status_code}: {r.text}")
        return False

    def _plain(self, path: str, body: dict) -> None:
        r = self.http.post(path, json=body)
        if not self._accepted(r, path):
            return
        data = r.json()
        self._completed(data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"], path)

    def _stream(self, path: str, body: dict) -> None:
        with self.http.stream("POST", path, json=body) as r:
            if not self._accepted(r, path):
                return
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            self.tally.error(f"{path}: stream ended without [DONE]: {lines[-2:]}")
            return
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        if any("error" in c for c in chunks):
            self.tally.error(f"{path}: error event {chunks[-1]}")
            return
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        self._completed(reasons[-1], chunks[-1]["usage"]["completion_tokens"], path)

    def _completed(self, reason: str | None, n_tokens: int, what: str) -> None:
        if reason not in SIGNATURE_OK:
            self.tally.error(f"{what}: finish_reason {reason!r}")
            return
        with self.tally.lock:
            self.tally.completed[reason] += 1
            self.tally.tokens += n_tokens


def metrics_snapshot(text: str) -> dict[str, float]:
    """The server's counters that the tally reconciles against."""
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(dlfp_[a-z_]+_total)(\{[^}]*\})? (\S+)$", text, re.M):
        out[name + (labels or "")] = out.get(name + (labels or ""), 0.0) + float(value)
    for name, value in re.findall(r"^(dlfp_requests_in_flight) (\S+)$", text, re.M):
        out[name] = float(value)
    return out


def _sum(snapshot: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in snapshot.items() if k.split("{")[0] == name and all(w in k for w in want))


def reconcile(tally: Tally, m: dict[str, float]) -> dict[str, dict]:
    """Each check: what the clients counted, what /metrics says, and whether they agree."""
    checks = {}
    for reason in SIGNATURE_OK:
        server = _sum(m, "dlfp_requests_total", finish_reason=reason)
        checks[f"finished_{reason}"] = {"client": tally.completed[reason], "server": server,
                                        "ok": server == tally.completed[reason]}
    aborts = _sum(m, "dlfp_requests_total", finish_reason="abort")
    checks["finished_abort"] = {"client": tally.hung_up, "server": aborts, "ok": aborts == tally.hung_up}
    errors = _sum(m, "dlfp_requests_total", finish_reason="error")
    checks["finished_error"] = {"client": 0, "server": errors, "ok": errors == 0}
    sent = _sum(m, "dlfp_generation_tokens_total")
    low, high = tally.tokens + tally.hung_up_tokens, tally.tokens + tally.hung_up_max
    checks["tokens_sent"] = {"client": [low, high], "server": sent, "ok": low <= sent <= high,
                             "note": "exact for completed requests; hung-up streams add between what the client "
                                     "read and their max_tokens"}
    r429 = _sum(m, "dlfp_requests_rejected_total", status="429")
    checks["rejected_429"] = {"client": tally.rejected_429, "server": r429, "ok": r429 == tally.rejected_429}
    left = m.get("dlfp_requests_in_flight", 0.0)
    checks["in_flight_at_end"] = {"client": 0, "server": left, "ok": left == 0}
    return checks


def rss_growth(samples: list[tuple[float, float]], from_s: float) -> dict:
    """RSS change from the first sample at or after `from_s` to the last one."""
    later = [s for s in samples if s[0] >= from_s]
    if len(later) < 2:
        return {"from_s": from_s, "percent": None, "note": "too few samples after the warm-up"}
    (t0, r0), (t1, r1) = later[0], later[-1]
    return {"from_s": t0, "to_s": t1, "from_mb": r0, "to_mb": r1, "percent": 100.0 * (r1 - r0) / r0}


class ServerProcess:
    def __init__(self, serve_args: list[str], api_key: str | None):
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.log = Path(f"/tmp/dlfp-soak-{port}.log")
        cmd = [sys.executable, "-m", "dlfp.cli", "serve", "--port", str(port), *serve_args]
        env_key = ["--api-key", api_key] if api_key else []
        self.proc = subprocess.Popen(cmd + env_key, stderr=self.log.open("w"), stdout=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=self.base, timeout=30)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"dlfp serve exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise UserError("dlfp serve did not come up in 300 s")

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def metrics(self, settle_s: float = 30.0) -> dict[str, float]:
        """The counters once nothing is in flight (a hung-up stream is counted when the server notices)."""
        deadline = time.monotonic() + settle_s
        while self.http.get("/health").json().get("in_flight") and time.monotonic() < deadline:
            time.sleep(0.1)
        return metrics_snapshot(self.http.get("/metrics").text)

    def stop(self, timeout: float = 60) -> int | None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def run_soak(minutes: float, clients: int, serve_args: list[str], sample_s: float, warmup_s: float,
             seed: int, bg_chars: int = 1500, api_key: str | None = None, on_sample=None) -> dict:
    from dlfp.workloads.laptop import load_documents

    docs = [d.text for d in load_documents(None)]
    server = ServerProcess(serve_args, api_key)
    tally = Tally()
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    until = t0 + minutes * 60
    try:
        workers = [threading.Thread(target=Client(server.base, tally, seed + i, docs, api_key, bg_chars).run,
                                    args=(until,), daemon=True) for i in range(clients)]
        for w in workers:
            w.start()
        next_sample = time.monotonic()
        while any(w.is_alive() for w in workers):
            if time.monotonic() >= next_sample:
                samples.append((round(time.monotonic() - t0, 1), round(server.rss_mb(), 2)))
                if on_sample:
                    on_sample(samples[-1], tally)
                next_sample += sample_s
            time.sleep(0.2)
        samples.append((round(time.monotonic() - t0, 1), round(server.rss_mb(), 2)))
        snapshot = server.metrics()
    finally:
        exit_code = server.stop()
    checks = reconcile(tally, snapshot)
    growth = rss_growth(samples, warmup_s)
    result = {
        "minutes": minutes, "clients": clients, "bg_chars": bg_chars, "serve_args": serve_args, "seed": seed,
        "requests_completed": sum(tally.completed.values()), "finish_reasons": dict(tally.completed),
        "completion_tokens": tally.tokens, "hung_up": tally.hung_up, "bad_bodies_answered": tally.bad_ok,
        "rejected_429": tally.rejected_429, "status_5xx": tally.status_5xx, "errors": len(tally.errors),
        "error_examples": tally.errors[:20],
        "rss_samples": samples, "rss_growth": growth, "reconciliation": checks,
        "drain_exit_code": exit_code, "server_log": str(server.log),
    }
    result["pass"] = bool(not tally.errors and all(c["ok"] for c in checks.values()) and exit_code == 0)
    return result


@click.command()
@click.option("--minutes", type=click.FloatRange(0, min_open=True), default=60.0, show_default=True)
@click.option("--clients", type=click.IntRange(1), default=2, show_default=True)
@click.option("--max-queue", type=click.IntRange(0), default=64, show_default=True, help="The server's --max-queue.")
@click.option("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M).")
@click.option("--policy", default="dlfp", show_default=True)
@click.option("--threads", type=int, default=None, help="The server's CPU threads.")
@click.option("--sample-s", type=click.FloatRange(0.5), default=10.0, show_default=True,
              help="Seconds between RSS samples.")
@click.option("--warmup-min", type=click.FloatRange(0), default=5.0, show_default=True,
              help="RSS growth is measured from this minute to the end (capped at a third of the run).")
@click.option("--max-rss-growth", type=float, default=2.0, show_default=True,
              help="Percent RSS growth after the warm-up that fails the soak.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--bg-chars", type=click.IntRange(1), default=1500, show_default=True,
              help="Characters of document text in each background prompt (~4 per token).")
@click.option("--load-test", is_flag=True,
              help="Overload mode: 429s are expected; judged on zero 5xx/errors and every accepted request "
                   "completed, RSS reported but not judged. Use with --clients 40 --max-queue 8 --minutes 3.")
@click.option("--out", type=click.Path(), default="runs/soak/result.json", show_default=True)
def soak(minutes, clients, max_queue, model, policy, threads, sample_s, warmup_min, max_rss_growth, seed, bg_chars,
         load_test, out):
    """Mixed traffic against a fresh `dlfp serve`: RSS over time, errors, /metrics reconciled."""
    args = ["--policy", policy, "--max-queue", str(max_queue)]
    args += ["--model", model] if model else []
    args += ["--threads", str(threads)] if threads else []
    warmup_s = min(warmup_min * 60, minutes * 60 / 3)

    def show(sample, tally):
        click.echo(f"  t={sample[0]:7.1f} s  rss {sample[1]:8.1f} MB  completed {sum(tally.completed.values())}"
                   f"  429s {tally.rejected_429}  errors {len(tally.errors)}", err=True)

    result = run_soak(minutes, clients, args, sample_s, warmup_s, seed, bg_chars, on_sample=show)
    growth = result["rss_growth"]["percent"]
    result["mode"] = "load-test" if load_test else "soak"
    result["max_rss_growth_percent"] = None if load_test else max_rss_growth
    if not load_test and (growth is None or growth >= max_rss_growth):
        result["pass"] = False
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    bad = [k for k, c in result["reconciliation"].items() if not c["ok"]]
    click.echo(f"completed {result['requests_completed']} ({result['finish_reasons']}), hung up {result['hung_up']}, "
               f"429s {result['rejected_429']}, errors {result['errors']}; RSS growth after "
               f"{result['rss_growth']['from_s']:.0f} s: "
               f"{'n/a' if growth is None else f'{growth:+.2f}%'}; counters "
               f"{'reconciled' if not bad else 'NOT reconciled: ' + ', '.join(bad)}; "
               f"drain exit {result['drain_exit_code']}")
    click.echo(f"{'PASS' if result['pass'] else 'FAIL'}: {path}")
    if not result["pass"]:
        sys.exit(1)

