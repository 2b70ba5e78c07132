"""The Batch API's state in one SQLite database (WAL): files, batches and every request's result.

Durability is the point. Each finished request is one transaction that marks its
row done (or failed) with its output line and bumps its batch's counters, so after
any crash, `kill -9` included, the database holds every result that was reported
finished and nothing half-written. Rows still `queued` are exactly the requests to
run again; a batch's output file is built from its rows (one per input line) when
the last one finishes, in the transaction that completes the batch, so each
`custom_id` appears exactly once. `synchronous=FULL` makes each commit survive a
power loss too, at one fsync per finished request (requests take far longer).

The class is synchronous and holds one connection; the server calls it from one
worker thread (`batch_service.AsyncStore`), so the event loop never waits on disk.
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dlfp.server import batch_output
from dlfp.server.batch_input import InputLine

DB_NAME = "batches.sqlite3"
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
FILE_PURPOSES = ("batch",)  # what may be uploaded; output and error files are "batch_output"

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, input_file_id TEXT NOT NULL,
    model TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expires_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT NOT NULL,
    body TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'queued', result TEXT,
    PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS requests_by_state ON requests (batch_id, state, line);
"""


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class BatchStore:
    def __init__(self, folder: Path, clock: Callable[[], float] = time.time):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / DB_NAME
        self.clock = clock
        # isolation_level=None: no implicit transactions; each write below is one explicit transaction.
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def now(self) -> int:
        return int(self.clock())

    # -- files -------------------------------------------------------------
    def add_file(self, filename: str, purpose: str, content: bytes) -> dict:
        fid = _new_id("file-")
        with self._tx():
            self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                            (fid, purpose, filename, len(content), self.now(), content))
        return self.get_file(fid)

    def get_file(self, file_id: str) -> dict | None:
        row = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?",
                              (file_id,)).fetchone()
        return None if row is None else file_object(row)

    def list_files(self, purpose: str | None = None) -> list[dict]:
        rows = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files "
                               "WHERE ? IS NULL OR purpose = ? ORDER BY created_at, rowid", (purpose, purpose))
        return [file_object(r) for r in rows]

    def file_content(self, file_id: str) -> bytes | None:
        row = self.db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row["content"])

    def delete_file(self, file_id: str) -> bool:
        """A batch keeps its own copy of its requests, so deleting its input file harms nothing."""
        with self._tx():
            return self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 1

    # -- batches -----------------------------------------------------------
    def create_batch(self, input_file_id: str, model: str, endpoint: str, window: str, window_s: int,
                     metadata: dict | None, lines: list[InputLine], max_active: int) -> dict | None:
        """The new batch with every request queued, or None when `max_active` batches are unfinished
        (checked in the same transaction, so concurrent creates cannot pass the limit together).
        `model` is the served model's name: only a server of that model runs the batch."""
        bid, now = _new_id("batch_"), self.now()
        with self._tx():
            if self.count_active() >= max_active:
                return None
            self.db.execute(
                "INSERT INTO batches (id, input_file_id, model, endpoint, completion_window, metadata, status, "
                "created_at, in_progress_at, expires_at, total) VALUES (?, ?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, ?)",
                (bid, input_file_id, model, endpoint, window,
                 json.dumps(metadata) if metadata is not None else None, now, now, now + window_s, len(lines)))
            self.db.executemany("INSERT INTO requests (batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                                [(bid, x.line, x.custom_id, x.url, json.dumps(x.body)) for x in lines])
        return self.get_batch(bid)

    def get_batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else batch_object(row)

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, as OpenAI lists them; `after` is the last id of the previous page."""
        start = None
        if after is not None:
            start = self.db.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
            if start is None:
                return [], False
        rows = self.db.execute("SELECT * FROM batches WHERE ? IS NULL OR seq < ? ORDER BY seq DESC LIMIT ?",
                               (None if start is None else start["seq"], None if start is None else start["seq"],
                                limit + 1)).fetchall()
        return [batch_object(r) for r in rows[:limit]], len(rows) > limit

    def count_active(self) -> int:
        marks = ",".join("?" * len(ACTIVE))
        return self.db.execute(f"SELECT count(*) FROM batches WHERE status IN ({marks})", ACTIVE).fetchone()[0]

    def active_batches(self) -> list[tuple[str, str, str, int | None]]:
        """(id, model, status, expires_at) of every unfinished batch, oldest first: the work after a restart."""
        marks = ",".join("?" * len(ACTIVE))
        rows = self.db.execute(f"SELECT id, model, status, expires_at FROM batches WHERE status IN ({marks}) "
                               f"ORDER BY seq", ACTIVE)
        return [(r["id"], r["model"], r["status"], r["expires_at"]) for r in rows]

    def queued_lines(self, batch_id: str) -> list[int]:
        rows = self.db.execute("SELECT line FROM requests WHERE batch_id = ? AND state = 'queued' ORDER BY line",
                               (batch_id,))
        return [r[0] for r in rows]

    def request(self, batch_id: str, line: int) -> tuple[str, str, dict]:
        row = self.db.execute("SELECT custom_id, url, body FROM requests WHERE batch_id = ? AND line = ?",
                              (batch_id, line)).fetchone()
        return row["custom_id"], row["url"], json.loads(row["body"])

    def finish(self, batch_id: str, line: int, ok: bool, result: str, usage: Usage = Usage()) -> bool:
        """Record one request's end: its row and its batch's counters in one transaction.
        False (and nothing written) when the row was not queued any more."""
        with self._tx():
            cur = self.db.execute("UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND line = ? "
                                  "AND state = 'queued'", ("done" if ok else "failed", result, batch_id, line))
            if cur.rowcount != 1:
                return False
            column = "completed" if ok else "failed"
            self.db.execute(f"UPDATE batches SET {column} = {column} + 1, input_tokens = input_tokens + ?, "
                            f"cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                            (usage.input_tokens, usage.cached_tokens, usage.output_tokens, batch_id))
        return True

    def cancel(self, batch_id: str) -> dict | None:
        """Mark an unfinished batch `cancelling` (the runner stops it); a finished one is returned as is."""
        with self._tx():
            self.db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? "
                            "AND status IN ('validating', 'in_progress')", (self.now(), batch_id))
        return self.get_batch(batch_id)

    def finalize(self, batch_id: str, status: str) -> dict:
        """End a batch: write its output file (answered requests) and error file (failed ones, and
        for a cancelled or expired batch those that never ran), then set `status`, in one transaction."""
        assert status in ("completed", "cancelled", "expired"), status
        code = {"cancelled": batch_output.CANCELLED, "expired": batch_output.EXPIRED}.get(status)
        now = self.now()
        with self._tx():
            row = self.db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row["status"] in TERMINAL:
                return self.get_batch(batch_id)  # finalized already: its files stay as they are
            out, err = [], []
            rows = self.db.execute("SELECT line, custom_id, state, result FROM requests WHERE batch_id = ? "
                                   "ORDER BY line", (batch_id,))
            for r in rows:
                if r["state"] == "done":
                    out.append(r["result"])
                elif r["state"] == "failed":
                    err.append(r["result"])
                elif code is not None:
                    err.append(batch_output.not_run(batch_id, r["line"], r["custom_id"], code))
            out_id = self._output_file(f"{batch_id}_output.jsonl", out)
            err_id = self._output_file(f"{batch_id}_error.jsonl", err)
            stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]
            self.db.execute(f"UPDATE batches SET status = ?, finalizing_at = ?, {stamp} = ?, output_file_id = ?, "
                            f"error_file_id = ? WHERE id = ?", (status, now, now, out_id, err_id, batch_id))
        return self.get_batch(batch_id)

    def _output_file(self, name: str, lines: list[str]) -> str | None:
        if not lines:
            return None  # as OpenAI: no file, and a null id, when there is nothing to put in it
        content = ("\n".join(lines) + "\n").encode()
        fid = _new_id("file-")
        self.db.execute("INSERT INTO files VALUES (?, 'batch_output', ?, ?, ?, ?)",
                        (fid, name, len(content), self.now(), content))
        return fid

    # -- /metrics ----------------------------------------------------------
    def stats(self) -> dict:
        by_status = {r[0]: r[1] for r in self.db.execute("SELECT status, count(*) FROM batches GROUP BY status")}
        marks = ",".join("?" * len(ACTIVE))
        done, failed, queued = self.db.execute(
            f"SELECT coalesce(sum(completed), 0), coalesce(sum(failed), 0), "
            f"coalesce(sum(CASE WHEN status IN ({marks}) THEN total - completed - failed ELSE 0 END), 0) "
            f"FROM batches", ACTIVE).fetchone()
        return {"batches": by_status, "requests": {"done": done, "failed": failed, "queued": queued},
                "journal_bytes": self.journal_bytes()}

    def journal_bytes(self) -> int:
        """The database's size on disk, its write-ahead log included."""
        paths = [self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")]
        return sum(os.path.getsize(p) for p in paths if p.exists())

    # -- helpers -----------------------------------------------------------
    def _tx(self):
        return _Transaction(self.db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK when the block raises."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, exc, tb) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


def batch_object(row: sqlite3.Row) -> dict:
    n_in, n_out = row["input_tokens"], row["output_tokens"]
    return {
        "id": row["id"], "object": "batch", "model": row["model"], "endpoint": row["endpoint"], "errors": None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        **{k: row[k] for k in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                               "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] is not None else None,
        "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
                  "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": n_in + n_out},
    }
