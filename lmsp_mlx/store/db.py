"""The embedded SQLite file behind stored responses, tasks, their events and idempotency keys.

One connection in WAL mode, shared by the event loop and the threads that call into it
under a lock: every statement here is a short indexed read or a small write, and WAL lets
the `sqlite3` shell (or a second reader) look at the file while the server runs. The
schema version lives in `PRAGMA user_version`; a file from a newer lmsp-mlx is refused
rather than written with a schema it does not know.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

SCHEMA_VERSION = 2  # 2: tasks.framing (/v1 background responses keep Open Responses events)

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    previous_response_id TEXT,
    created_at REAL NOT NULL,
    completed_at INTEGER,
    request TEXT NOT NULL,        -- the request as validated, JSON (its input items included)
    response TEXT NOT NULL        -- the LMSP response object, JSON
);
CREATE INDEX IF NOT EXISTS responses_created ON responses(created_at);

CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,         -- queued, in_progress, completed, incomplete, failed, cancelled
    response_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    ended_at REAL,
    last_event_id INTEGER NOT NULL DEFAULT 0,
    events_expired INTEGER NOT NULL DEFAULT 0,
    request TEXT NOT NULL,
    response TEXT,                -- the final response object once it ended, JSON
    framing TEXT NOT NULL DEFAULT 'lmsp'  -- its events' shape: 'lmsp' (section 6.3) or 'v1' (Open Responses)
);
CREATE INDEX IF NOT EXISTS tasks_status ON tasks(status);
CREATE INDEX IF NOT EXISTS tasks_response ON tasks(response_id);

CREATE TABLE IF NOT EXISTS task_events (
    task_id TEXT NOT NULL,
    id INTEGER NOT NULL,          -- the SSE id, from 1
    event TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (task_id, id)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS idempotency_keys (
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    task_id TEXT NOT NULL,        -- the work the first request started
    created_at REAL NOT NULL,
    PRIMARY KEY (owner, key)
);
"""


class StoreError(RuntimeError):
    """The store file cannot be opened or is not one of ours."""


class StoreUnavailable(StoreError):
    """The store cannot be used now (a full disk, a lock another process holds past the busy
    timeout, an I/O error): what is stored stays as it was (the statement's transaction is
    rolled back), and it is used again as soon as it can be."""


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a file of an older schema up to this one (CREATE ... IF NOT EXISTS left its tables as they were)."""
    if "framing" not in {row[1] for row in conn.execute("PRAGMA table_info(tasks)")}:  # schema 1
        conn.execute("ALTER TABLE tasks ADD COLUMN framing TEXT NOT NULL DEFAULT 'lmsp'")


class Database:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():  # it holds conversations: the owner's alone (its -wal and -shm follow it)
                path.touch(mode=0o600)
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across crashes of the process
            self._conn.execute("PRAGMA busy_timeout=5000")
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"{path} was written by a newer lmsp-mlx (schema {version}, this one knows {SCHEMA_VERSION})")
            self._conn.executescript(SCHEMA)
            _migrate(self._conn)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the store {path}: {exc}") from None
        self._lock = threading.Lock()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic unit of work: committed when the block ends, rolled back if it raises.
        StoreUnavailable where SQLite cannot write now (sqlite3.OperationalError)."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise StoreUnavailable(f"the store {self.path} cannot be written now: {exc}") from None
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException as exc:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError):
                    raise StoreUnavailable(f"the store {self.path} cannot be written now: {exc}") from None
                raise

    def query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row | tuple[Any, ...]]:
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                raise StoreUnavailable(f"the store {self.path} cannot be read now: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def now() -> float:
    return time.time()
