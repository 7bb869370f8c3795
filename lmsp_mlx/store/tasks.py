"""Tasks and their event logs (section 6.4): a client that lost its stream resumes it here.

Events are written in batches by the task's driver (lmsp_mlx/service/tasks.py); the final
batch and the task's end are one transaction, so a reader never sees an ended task with
events missing. The sweep drops event logs `event_retention` seconds after their task
ended and marks the task, which then answers 410 `event_history_expired`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from .db import Database, now

ENDED = ("completed", "incomplete", "failed", "cancelled")

# The shape of a task's events: "lmsp" (section 6.3, ids from 1), or "v1" (a /v1 background
# response's Open Responses events, whose sequence_number is the id - 1).
Framing = Literal["lmsp", "v1"]


@dataclass
class TaskRecord:
    id: str
    owner: str
    status: str
    response_id: str
    created_at: float
    ended_at: float | None
    last_event_id: int
    events_expired: bool
    response: dict[str, Any] | None
    request: dict[str, Any]
    framing: Framing = "lmsp"


@dataclass(frozen=True)
class StoredEvent:
    id: int
    event: str
    data: dict[str, Any]


_COLUMNS = ("id, owner, status, response_id, created_at, ended_at, last_event_id, events_expired, response, request,"
            " framing")


def _record(row) -> TaskRecord:
    return TaskRecord(*row[:7], bool(row[7]), json.loads(row[8]) if row[8] else None, json.loads(row[9]), row[10])


class TaskLog:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, task_id: str, owner: str, response_id: str, request: dict[str, Any],
               framing: Framing = "lmsp") -> None:
        with self.db.transaction() as c:
            c.execute(
                "INSERT INTO tasks (id, owner, status, response_id, created_at, request, framing)"
                " VALUES (?, ?, 'queued', ?, ?, ?, ?)",
                (task_id, owner, response_id, now(), json.dumps(request, ensure_ascii=False), framing),
            )

    def get(self, owner: str, task_id: str) -> TaskRecord | None:
        rows = self.db.query(f"SELECT {_COLUMNS} FROM tasks WHERE id = ? AND owner = ?", (task_id, owner))
        return _record(rows[0]) if rows else None

    def of_response(self, owner: str, response_id: str) -> TaskRecord | None:
        """The task that ran a response, if one did (a /v1 background response, an LMSP task)."""
        rows = self.db.query(f"SELECT {_COLUMNS} FROM tasks WHERE response_id = ? AND owner = ?"
                             " ORDER BY created_at DESC LIMIT 1", (response_id, owner))
        return _record(rows[0]) if rows else None

    def forget_response(self, owner: str, response_id: str) -> None:
        """Drop the tasks that ran a deleted response, and their events: they hold its output."""
        with self.db.transaction() as c:
            ids = [r[0] for r in c.execute("SELECT id FROM tasks WHERE response_id = ? AND owner = ?",
                                           (response_id, owner))]
            for task_id in ids:
                c.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
                c.execute("DELETE FROM tasks WHERE id = ?", (task_id,))

    def append(self, task_id: str, events: Iterable[StoredEvent], status: str | None = None,
               response: dict[str, Any] | None = None) -> None:
        """Add a batch of events; with `status`, also record the task's new status (and, for
        an ending status, its final response) in the same transaction."""
        events = list(events)
        with self.db.transaction() as c:
            c.executemany(
                "INSERT OR IGNORE INTO task_events (task_id, id, event, data) VALUES (?, ?, ?, ?)",
                [(task_id, e.id, e.event, json.dumps(e.data, ensure_ascii=False)) for e in events],
            )
            if events:
                c.execute("UPDATE tasks SET last_event_id = MAX(last_event_id, ?) WHERE id = ?", (events[-1].id, task_id))
            if status is not None:
                ended = now() if status in ENDED else None
                c.execute(
                    "UPDATE tasks SET status = ?, ended_at = COALESCE(?, ended_at), response = COALESCE(?, response)"
                    " WHERE id = ?",
                    (status, ended, json.dumps(response, ensure_ascii=False) if response else None, task_id),
                )

    def events_after(self, task_id: str, after: int) -> list[StoredEvent]:
        rows = self.db.query(
            "SELECT id, event, data FROM task_events WHERE task_id = ? AND id > ? ORDER BY id", (task_id, after)
        )
        return [StoredEvent(r[0], r[1], json.loads(r[2])) for r in rows]

    def unfinished(self) -> list[TaskRecord]:
        rows = self.db.query(f"SELECT {_COLUMNS} FROM tasks WHERE status IN ('queued', 'in_progress')")
        return [_record(r) for r in rows]

    def sweep(self, events_before: float, tasks_before: float) -> tuple[int, int]:
        """Drop the event logs of tasks that ended before `events_before`, and whole tasks
        created before `tasks_before`; returns (event logs dropped, tasks dropped)."""
        with self.db.transaction() as c:
            expired = [r[0] for r in c.execute(
                "SELECT id FROM tasks WHERE ended_at IS NOT NULL AND ended_at < ? AND events_expired = 0", (events_before,)
            )]
            for task_id in expired:
                c.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
                c.execute("UPDATE tasks SET events_expired = 1 WHERE id = ?", (task_id,))
            old = [r[0] for r in c.execute(
                "SELECT id FROM tasks WHERE created_at < ? AND ended_at IS NOT NULL", (tasks_before,)
            )]
            for task_id in old:
                c.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
                c.execute("DELETE FROM tasks WHERE id = ?", (task_id,))
        return len(expired), len(old)
