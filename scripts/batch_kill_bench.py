"""The Batch API under kill -9: nothing lost, nothing twice, the same answers, and what it costs.

    .venv/bin/python scripts/batch_kill_bench.py --out runs/2026-12-02-batch-kill

Three phases on `dlfp serve` with the default model, each on a fresh state folder:
1. direct: the N folder requests sent one by one as plain /v1/chat/completions calls at
   background priority (X-Priority), as many in flight as the batch runner keeps (the
   engine's sequence slots): the throughput a hand-written client gets;
2. batch: the same requests as one batch from `dlfp batch submit FOLDER`, uninterrupted:
   the batch's throughput, and the reference answers;
3. kill: the same batch again while a chat streams from the official `openai` client; the
   server is killed with SIGKILL at K random moments (each after a random count of finished
   requests, plus a random delay) and restarted at once on the same state folder.
Reported: requests lost, duplicated, and answering differently from phase 2 (and from
phase 1); each restart's time to /health 200 and to the next committed result; batch
throughput of phase 2 over phase 1; the chat's ITL (client-side gaps between streamed
tokens) outside the restarts, against the profile's target T.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import httpx
import numpy as np

from dlfp.batch_cli import DEFAULT_PROMPT, folder_requests
from dlfp.cli import get_profile
from dlfp.models import default_model_path
from dlfp.provenance import write_config
from dlfp.workloads.laptop import load_chat_script, load_documents

POLL_S = 0.05


def make_documents(folder: Path, n: int) -> None:
    """N short, distinct text files cut from the bundled sample corpus (deterministic)."""
    docs = load_documents(None)
    sentences = [[s.strip() + "." for s in re.split(r"\.\s+", d.text) if s.strip()] for d in docs]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pool = sentences[i % len(docs)]
        start, count = (i * 7) % len(pool), 1 + i % 2  # short: the prompt, not the answer, is the cost
        picked = [pool[(start + k) % len(pool)] for k in range(count)]
        (folder / f"note-{i:03d}.txt").write_text(f"Note {i}: {docs[i % len(docs)].name}\n" + " ".join(picked) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int, state: Path, log: Path, extra: list[str]):
        self.root = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "dlfp.cli", "serve", "--port", str(port), "--state-dir", str(state), *extra]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> tuple[float, float]:
        """Start and wait for /health 200; returns (start time, healthy time), monotonic."""
        t0 = time.monotonic()
        with self.log.open("a") as f:
            self.proc = subprocess.Popen(self.cmd, stderr=f, stdout=f)
        with httpx.Client(timeout=5) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"dlfp serve exited: see {self.log}")
                try:
                    if http.get(self.root + "/health").status_code == 200:
                        return t0, time.monotonic()
                except httpx.TransportError:
                    pass
                time.sleep(POLL_S)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def batch_state(http: httpx.Client, batch_id: str) -> dict | None:
    try:
        r = http.get(f"/v1/batches/{batch_id}")
        return r.json() if r.status_code == 200 else None
    except httpx.TransportError:
        return None


def contents_of(lines: list[str]) -> dict[str, list[str]]:
    """custom_id -> every answer text given for it (a list, so duplicates show)."""
    out: dict[str, list[str]] = {}
    for raw in lines:
        x = json.loads(raw)
        body = (x.get("response") or {}).get("body") or {}
        text = body["choices"][0]["message"]["content"] if "choices" in body else None
        out.setdefault(x["custom_id"], []).append(text)
    return out


def run_direct(server: Server, requests: list[dict], in_flight: int) -> dict:
    def one(item: dict) -> tuple[str, str, int]:
        r = http.post("/v1/chat/completions", json=item["body"], headers={"X-Priority": "background"})
        r.raise_for_status()
        body = r.json()
        return item["custom_id"], body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]

    with httpx.Client(base_url=server.root, timeout=600) as http:
        t0 = time.monotonic()
        with ThreadPoolExecutor(in_flight) as pool:
            answers = list(pool.map(one, requests))
        wall = time.monotonic() - t0
    return {"wall_s": wall, "answers": {c: t for c, t, _ in answers}, "tokens": sum(n for *_, n in answers)}


def submit(server: Server, folder: Path, max_tokens: int, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dlfp.cli", "batch", "submit", str(folder), "--server", server.root,
           "--max-tokens", str(max_tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("a"), text=True)
    batch_id = proc.stdout.readline().strip()
    if not batch_id.startswith("batch_"):
        raise RuntimeError(f"dlfp batch submit failed: see {log}")
    return proc, batch_id


def results(server: Server, batch_id: str) -> list[str]:
    with httpx.Client(base_url=server.root, timeout=60) as http:
        b = http.get(f"/v1/batches/{batch_id}").json()
        lines = []
        for key in ("output_file_id", "error_file_id"):
            if b.get(key):
                lines += http.get(f"/v1/files/{b[key]}/content").text.splitlines()
    return lines


def run_batch(server: Server, folder: Path, max_tokens: int, log: Path) -> dict:
    t0 = time.monotonic()
    follower, batch_id = submit(server, folder, max_tokens, log)
    with httpx.Client(base_url=server.root, timeout=30) as http:
        while (b := batch_state(http, batch_id)) is None or b["status"] != "completed":
            time.sleep(POLL_S)
    wall = time.monotonic() - t0
    follower.wait(60)
    return {"wall_s": wall, "batch": b, "lines": results(server, batch_id), "follower_rc": follower.returncode}


class Chat(threading.Thread):
    """A foreground chat from the official client: streamed turns back to back, token gaps timed here."""

    def __init__(self, base: str, max_tokens: int, think_s: float):
        super().__init__(daemon=True)
        import openai

        self.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
        script = load_chat_script(None)
        self.system, self.turns = script.system, script.turns
        self.max_tokens, self.think_s = max_tokens, think_s
        self.model = self.client.models.list().data[0].id
        self.stop_flag = threading.Event()
        self.done: list[dict] = []  # turns that streamed to the end: {"t0", "t1", "gaps"}
        self.failed = 0  # attempts cut or refused while the server was down

    def run(self) -> None:
        i = 0
        while not self.stop_flag.is_set():
            turn = self.turns[i % len(self.turns)]
            i += 1
            t0, times = time.monotonic(), []
            try:
                stream = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "system", "content": self.system},
                                               {"role": "user", "content": turn}],
                    max_tokens=self.max_tokens, temperature=0, stream=True)
                for chunk in stream:  # one chunk per token, after the role chunk; the usage chunk has no choices
                    if chunk.choices and chunk.choices[0].delta.role is None:
                        times.append(time.monotonic())
            except Exception:  # the server was killed mid-turn: this turn does not count
                self.failed += 1
                time.sleep(0.2)
                continue
            self.done.append({"t0": t0, "t1": time.monotonic(), "gaps": np.diff(times).tolist()})
            self.stop_flag.wait(self.think_s)


def run_kill(server: Server, folder: Path, max_tokens: int, kills: int, rng: random.Random, log: Path,
             chat_tokens: int, think_s: float) -> dict:
    n = len(list(folder.iterdir()))
    thresholds = sorted(rng.sample(range(int(0.08 * n), int(0.9 * n)), kills))
    chat = Chat(server.root, chat_tokens, think_s)
    chat.start()
    time.sleep(1.0)  # the chat is streaming before the batch starts
    t0 = time.monotonic()
    follower, batch_id = submit(server, folder, max_tokens, log)
    events = []
    with httpx.Client(base_url=server.root, timeout=30) as http:
        for threshold in thresholds:
            while (b := batch_state(http, batch_id)) is None or b["request_counts"]["completed"] < threshold:
                time.sleep(POLL_S)
            time.sleep(rng.uniform(0.0, 2.0))  # a random moment, most likely with requests in flight
            seen = batch_state(http, batch_id)
            t_kill = time.monotonic()
            server.kill9()
            t_start, t_healthy = server.start()
            kept = batch_state(http, batch_id)["request_counts"]["completed"]  # what the database held
            while not http.get("/health").json()["batch"]["in_flight"]:  # the runner has resubmitted
                time.sleep(POLL_S / 5)
            t_running = time.monotonic()
            while (b := batch_state(http, batch_id))["request_counts"]["completed"] <= kept and \
                    b["status"] != "completed":
                time.sleep(POLL_S)
            events.append({"threshold": threshold, "completed_seen_before_kill": seen["request_counts"]["completed"],
                           "completed_after_restart": kept, "t_kill": t_kill - t0,
                           "restart_to_healthy_s": t_healthy - t_start,
                           "restart_to_running_s": t_running - t_start,
                           "restart_to_next_result_s": time.monotonic() - t_start,
                           "kill_to_healthy_s": t_healthy - t_kill})
        while (b := batch_state(http, batch_id)) is None or b["status"] != "completed":
            time.sleep(POLL_S)
    wall = time.monotonic() - t0
    chat.stop_flag.set()
    chat.join(120)
    follower.wait(120)
    windows = [(t0 + e["t_kill"], t0 + e["t_kill"] + e["kill_to_healthy_s"]) for e in events]
    outside = [g for turn in chat.done for g in turn["gaps"]
               if not any(turn["t0"] < w1 and turn["t1"] > w0 for w0, w1 in windows)]
    return {"wall_s": wall, "batch": b, "lines": results(server, batch_id), "events": events,
            "follower_rc": follower.returncode, "chat_gaps_s": outside, "chat_turns": len(chat.done),
            "chat_turns_failed": chat.failed}


def compare(lines: list[str], reference: dict[str, str], ids: list[str]) -> dict:
    got = contents_of(lines)
    return {"lost": sum(1 for c in ids if c not in got),
            "duplicated": sum(1 for c in got if len(got[c]) > 1),
            "differing": sum(1 for c in ids if c in got and got[c][0] != reference.get(c)),
            "errors": sum(1 for c in ids if c in got and got[c][0] is None)}


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/2026-12-02-batch-kill"), show_default=True)
@click.option("--requests", "n", type=int, default=200, show_default=True)
@click.option("--max-tokens", type=int, default=8, show_default=True)
@click.option("--kills", type=int, default=5, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--chat-tokens", type=int, default=32, show_default=True)
@click.option("--chat-think-s", type=float, default=0.5, show_default=True)
@click.option("--serve-arg", "serve_args", multiple=True, help="Passed on to dlfp serve (repeatable).")
def main(out: Path, n: int, max_tokens: int, kills: int, seed: int, chat_tokens: int, chat_think_s: float,
         serve_args: tuple[str, ...]) -> None:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dlfp-batch-kill-"))
    folder = work / "docs"
    make_documents(folder, n)
    requests = folder_requests(folder, DEFAULT_PROMPT, max_tokens)
    ids = [r["custom_id"] for r in requests]
    corpus = hashlib.sha256(json.dumps(requests).encode()).hexdigest()
    target_ms = get_profile("cpu-laptop").itl_target_ms
    extra = ["--policy", "dlfp", *serve_args]
    log = work / "logs.txt"
    summary: dict = {"requests": n, "max_tokens": max_tokens, "kills": kills, "seed": seed, "itl_target_ms": target_ms}

    def fresh(name: str) -> Server:
        server = Server(free_port(), work / f"state-{name}", log, extra)
        server.start()
        return server

    server = fresh("direct")
    try:
        slots = httpx.get(server.root + "/health").json()["free_slots"]  # the runner's default window
        click.echo(f"direct: {n} requests, {slots} in flight", err=True)
        direct = run_direct(server, requests, slots)
    finally:
        server.stop()
    server = fresh("batch")
    try:
        click.echo("batch, uninterrupted", err=True)
        batch = run_batch(server, folder, max_tokens, log)
    finally:
        server.stop()
    reference = {c: t[0] for c, t in contents_of(batch["lines"]).items()}
    server = fresh("kill")
    try:
        click.echo(f"batch with a chat and {kills} kills", err=True)
        killed = run_kill(server, folder, max_tokens, kills, rng, log, chat_tokens, chat_think_s)
    finally:
        server.stop()

    gaps_ms = np.array(killed["chat_gaps_s"]) * 1e3
    summary |= {
        "direct": {"wall_s": direct["wall_s"], "requests_per_s": n / direct["wall_s"], "in_flight": slots,
                   "output_tokens": direct["tokens"]},
        "batch": {"wall_s": batch["wall_s"], "requests_per_s": n / batch["wall_s"],
                  "output_tokens": batch["batch"]["usage"]["output_tokens"], "cli_exit": batch["follower_rc"],
                  **compare(batch["lines"], direct["answers"], ids)},
        "throughput_ratio": direct["wall_s"] / batch["wall_s"],
        "killed": {"wall_s": killed["wall_s"], "cli_exit": killed["follower_rc"],
                   **compare(killed["lines"], reference, ids),
                   "differing_from_direct": compare(killed["lines"], direct["answers"], ids)["differing"],
                   "restarts": killed["events"]},
        "chat": {"turns": killed["chat_turns"], "attempts_failed_during_restarts": killed["chat_turns_failed"],
                 "itl_samples": int(gaps_ms.size),
                 "itl_p50_ms": float(np.percentile(gaps_ms, 50)) if gaps_ms.size else None,
                 "itl_p99_ms": float(np.percentile(gaps_ms, 99)) if gaps_ms.size else None,
                 "itl_p99_over_target": float(np.percentile(gaps_ms, 99)) / target_ms if gaps_ms.size else None},
    }
    restarts = killed["events"]
    keys = ("restart_to_healthy_s", "restart_to_running_s", "restart_to_next_result_s")
    summary["resume"] = {k: {"mean": float(np.mean([e[k] for e in restarts])),
                             "max": float(np.max([e[k] for e in restarts]))} for k in keys} if restarts else {}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_config(out, {"workload": {"requests": n, "max_tokens": max_tokens, "prompt": DEFAULT_PROMPT,
                                    "documents": "scripts/batch_kill_bench.py make_documents (bundled corpus)",
                                    "requests_sha256": corpus, "chat_tokens": chat_tokens,
                                    "chat_think_s": chat_think_s, "kills": kills, "seed": seed},
                       "serve_args": extra},
                 models=[default_model_path()])
    click.echo(json.dumps({k: v for k, v in summary.items() if k != "killed"} | {
        "killed": {k: v for k, v in summary["killed"].items() if k != "restarts"}}, indent=2))


if __name__ == "__main__":
    main()
