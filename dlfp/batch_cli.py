"""`dlfp batch`: submit a folder of documents (or a JSONL) to a running `dlfp serve`, and follow it.

    dlfp batch submit DIR|FILE.jsonl --server URL [--prompt TEMPLATE] [--max-tokens N]
    dlfp batch status ID | dlfp batch results ID --out FILE | dlfp batch cancel ID | dlfp batch list

A folder becomes one chat request per text file (its name is the custom_id), its
text put into the prompt template; a JSONL is uploaded as it is. `submit` follows
the batch with a live progress bar and keeps following across server restarts
(the batch resumes by itself). Talks plain HTTP (httpx) to the OpenAI-style routes.
"""
from __future__ import annotations

import json
import sys
import time
from collections import deque
from pathlib import Path

import click

from dlfp.cli import UserError

DEFAULT_SERVER = "http://127.0.0.1:8000"
DEFAULT_PROMPT = "Summarize the following document in three sentences.\n\n{text}"
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
FINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0
RATE_WINDOW_S = 30.0  # tokens/s over this much recent time


def folder_requests(folder: Path, template: str, max_tokens: int, temperature: float = 0.0,
                    model: str | None = None) -> list[dict]:
    """One chat request per text file of `folder` (sorted by name; custom_id = the file name)."""
    if "{text}" not in template:
        raise UserError("--prompt must contain {text}, where each document's text goes")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise UserError(f"no text files ({', '.join(TEXT_SUFFIXES)}) in {folder}")
    lines = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path} is not UTF-8 text") from None
        body = {"messages": [{"role": "user", "content": template.replace("{text}", text)}],
                "max_tokens": max_tokens, "temperature": temperature}
        if model:
            body["model"] = model
        lines.append({"custom_id": path.name, "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


class Client:
    """The Batch API over httpx; every failure becomes one line for the user."""

    def __init__(self, server: str, api_key: str | None, timeout: float = 60.0):
        try:
            import httpx
        except ImportError:
            raise UserError("dlfp batch needs httpx: install the server extra (pip install 'dlfp[server]')") from None
        base = server.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.server = base
        self.http = httpx.Client(base_url=base + "/v1", headers=headers, timeout=timeout)
        self.transport_error = httpx.TransportError

    def call(self, method: str, path: str, **kwargs):
        try:
            r = self.http.request(method, path, **kwargs)
        except self.transport_error as exc:
            raise UserError(f"cannot reach {self.server}: {exc}") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200]
            raise UserError(f"{method} /v1{path}: HTTP {r.status_code}: {message}")
        return r

    def upload(self, name: str, content: bytes) -> dict:
        return self.call("POST", "/files", files={"file": (name, content, "application/jsonl")},
                         data={"purpose": "batch"}).json()

    def create(self, file_id: str, endpoint: str, window: str) -> dict:
        return self.call("POST", "/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                                   "completion_window": window}).json()

    def batch(self, batch_id: str) -> dict:
        return self.call("GET", f"/batches/{batch_id}").json()

    def content(self, file_id: str) -> bytes:
        return self.call("GET", f"/files/{file_id}/content").content


def _client_options(f):
    f = click.option("--api-key", envvar="DLFP_API_KEY", default=None, show_envvar=True,
                     help="Sent as 'Authorization: Bearer KEY' (dlfp serve --api-key).")(f)
    f = click.option("--server", envvar="DLFP_SERVER", default=DEFAULT_SERVER, show_default=True, show_envvar=True,
                     help="The dlfp serve to talk to.")(f)
    return f


@click.group()
def batch() -> None:
    """Batches on a running `dlfp serve`: background work that survives restarts."""


@batch.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@_client_options
@click.option("--prompt", "template", default=DEFAULT_PROMPT, show_default=True,
              help="For a folder: the request for each file, with {text} where the file's text goes.")
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True,
              help="For a folder: tokens each summary may have.")
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True,
              help="For a folder: 0 is greedy (the same answer on every run).")
@click.option("--model", default=None, help="For a folder: the model id to name (default: the server's).")
@click.option("--completion-window", default="24h", show_default=True,
              help="Hours the batch may take before what has not run expires (e.g. 24h, 168h).")
@click.option("--no-wait", is_flag=True, help="Print the batch id and return without following it.")
def submit(source: Path, server, api_key, template, max_tokens, temperature, model, completion_window, no_wait):
    """Submit a folder of text files (one summary request each) or a JSONL file (sent as is)."""
    if source.is_dir():
        lines = folder_requests(source, template, max_tokens, temperature, model)
        content = ("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n").encode()
        name, endpoint = f"{source.name or 'folder'}.jsonl", "/v1/chat/completions"
    else:
        content = source.read_bytes()
        name, endpoint = source.name, _endpoint_of(content)
    client = Client(server, api_key)
    uploaded = client.upload(name, content)
    created = client.create(uploaded["id"], endpoint, completion_window)
    click.echo(f"batch {created['id']}: {created['request_counts']['total']} requests", err=True)
    click.echo(created["id"])  # alone on stdout, for scripts
    sys.stdout.flush()
    if no_wait:
        return
    final = follow(client, created["id"])
    _summary(final)
    if final["status"] != "completed":
        sys.exit(1)


def _endpoint_of(content: bytes) -> str:
    """The url of the file's first request (the server checks the rest)."""
    for raw in content.decode("utf-8", errors="replace").splitlines():
        if raw.strip():
            try:
                return json.loads(raw)["url"]
            except (ValueError, KeyError, TypeError):
                raise UserError("the file's first request has no url: each line needs "
                                "{custom_id, method, url, body}") from None
    raise UserError("the file has no requests")


def follow(client: Client, batch_id: str) -> dict:
    """Poll until the batch ends, with a progress bar; an unreachable server (a restart) is waited for."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[counts]}"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
    rate = _Rate()
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(batch_id, total=None, counts="", rate="")
        while True:
            try:
                current = client.batch(batch_id)
            except UserError as exc:
                if "cannot reach" not in str(exc) and "HTTP 503" not in str(exc):
                    raise
                progress.update(task, description=f"{batch_id} (server unreachable: waiting)")
                time.sleep(POLL_S)
                continue
            n = current["request_counts"]
            tokens = (current.get("usage") or {}).get("output_tokens", 0)
            progress.update(task, description=f"{batch_id} {current['status']}", total=n["total"],
                            completed=n["completed"] + n["failed"],
                            counts=f"{n['completed']} done, {n['failed']} failed / {n['total']}",
                            rate=f"{rate.add(tokens):.1f} tok/s")
            if current["status"] in FINAL:
                return current
            time.sleep(POLL_S)


class _Rate:
    """Output tokens per second over the last RATE_WINDOW_S."""

    def __init__(self):
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, tokens: int) -> float:
        now = time.monotonic()
        self.samples.append((now, tokens))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def _summary(b: dict) -> None:
    n = b["request_counts"]
    click.echo(f"{b['id']}: {b['status']}: {n['completed']} done, {n['failed']} failed of {n['total']}", err=True)
    if b.get("output_file_id") or b.get("error_file_id"):
        click.echo(f"  results: dlfp batch results {b['id']} --out FILE", err=True)


@batch.command()
@click.argument("batch_id")
@_client_options
@click.option("--json", "as_json", is_flag=True, help="Print the batch object as the server returns it.")
def status(batch_id, server, api_key, as_json):
    """Show a batch: its status, counts, tokens and files."""
    b = Client(server, api_key).batch(batch_id)
    if as_json:
        click.echo(json.dumps(b, indent=2))
        return
    n, usage = b["request_counts"], b.get("usage") or {}
    click.echo(f"{b['id']}  {b['status']}  {n['completed']} done, {n['failed']} failed of {n['total']}  "
               f"{usage.get('output_tokens', 0)} tokens out  created {_when(b['created_at'])}")
    for key in ("output_file_id", "error_file_id"):
        if b.get(key):
            click.echo(f"  {key}: {b[key]}")


@batch.command()
@click.argument("batch_id")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where the answers go (JSONL, one line per answered request, in input order).")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where failed requests go (default: OUT with .errors.jsonl).")
@_client_options
def results(batch_id, out: Path, errors: Path | None, server, api_key):
    """Download a finished batch's output file (and its error file when some requests failed)."""
    client = Client(server, api_key)
    b = client.batch(batch_id)
    if b["status"] not in FINAL:
        raise UserError(f"{batch_id} is {b['status']}: results come when it ends (dlfp batch status {batch_id})")
    errors = errors or out.with_name(out.stem + ".errors.jsonl")
    for key, path in (("output_file_id", out), ("error_file_id", errors)):
        if b.get(key):
            path.write_bytes(client.content(b[key]))
            click.echo(f"{path}: {sum(1 for _ in path.open())} line(s)", err=True)
        elif key == "output_file_id":
            click.echo(f"{batch_id}: no answered request, so no output file", err=True)


@batch.command()
@click.argument("batch_id")
@_client_options
def cancel(batch_id, server, api_key):
    """Stop a batch: nothing new starts, running requests are stopped, answered ones are kept."""
    b = Client(server, api_key).call("POST", f"/batches/{batch_id}/cancel").json()
    _summary(b)


@batch.command(name="list")
@_client_options
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True)
def list_batches(server, api_key, limit):
    """The newest batches on the server."""
    page = Client(server, api_key).call("GET", "/batches", params={"limit": limit}).json()
    for b in page["data"]:
        n = b["request_counts"]
        click.echo(f"{b['id']}  {b['status']:<11} {n['completed']}/{n['total']} done, {n['failed']} failed  "
                   f"created {_when(b['created_at'])}")


def _when(ts: int | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
