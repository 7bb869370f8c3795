"""Responses kept with `store: true`, and the conversation a `previous_response_id` names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .db import Database, now

# A chain longer than this is refused rather than walked: a cycle cannot be made through
# the API (ids are new), but a hand-edited file could hold one.
MAX_CHAIN = 10_000


@dataclass(frozen=True)
class Stored:
    request: dict[str, Any]  # as validated, with only its own input items
    response: dict[str, Any]  # the LMSP response object
    completed_at: int | None


class StoredResponses:
    def __init__(self, db: Database) -> None:
        self.db = db

    def put(self, owner: str, request: dict[str, Any], response: dict[str, Any], completed_at: int | None) -> None:
        """Keep a finished response: `request` as validated (its own input items only, not the
        chain before it), `response` the LMSP response object."""
        with self.db.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO responses"
                " (id, owner, previous_response_id, created_at, completed_at, request, response)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (response["id"], owner, request.get("previous_response_id"), now(), completed_at,
                 json.dumps(request, ensure_ascii=False), json.dumps(response, ensure_ascii=False)),
            )

    def recover(self, error: dict[str, Any]) -> int:
        """At start: responses the last process was still generating (kept in_progress when
        they started, so a crash does not lose them) end `failed` with `error`."""
        rows = self.db.query("SELECT id, response FROM responses WHERE completed_at IS NULL")
        failed = []
        for response_id, raw in rows:
            response = json.loads(raw)
            if response.get("status") in ("queued", "in_progress"):
                failed.append((json.dumps({**response, "status": "failed", "error": error}, ensure_ascii=False),
                               now(), response_id))
        with self.db.transaction() as c:
            c.executemany("UPDATE responses SET response = ?, completed_at = ? WHERE id = ?", failed)
        return len(failed)

    def get(self, owner: str, response_id: str) -> Stored | None:
        """A response this owner stored, or None."""
        rows = self.db.query(
            "SELECT request, response, completed_at FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
        )
        return Stored(json.loads(rows[0][0]), json.loads(rows[0][1]), rows[0][2]) if rows else None

    def delete(self, owner: str, response_id: str) -> bool:
        """Forget a stored response; a later response that continued it can no longer be
        continued past it (its chain is broken there, as on OpenAI)."""
        with self.db.transaction() as c:
            return c.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount > 0

    def conversation(self, owner: str, response_id: str,
                     local: dict[str, Stored] | None = None) -> list[dict[str, Any]] | None:
        """Every item of the stored chain ending at `response_id`, oldest first: each
        response's input items, then its output items (which are valid input items). None
        when the id (or a link of its chain) is not stored for this owner. `local` holds
        responses kept outside the store (a WebSocket connection's), looked up first."""
        turns: list[list[dict[str, Any]]] = []
        next_id: str | None = response_id
        while next_id is not None:
            if len(turns) >= MAX_CHAIN:
                return None
            found = local[next_id] if local and next_id in local else self.get(owner, next_id)
            if found is None:
                return None
            request, response = found.request, found.response
            turns.append(request.get("input", []) + response.get("output", []))
            next_id = request.get("previous_response_id")
        return [item for turn in reversed(turns) for item in turn]

    def sweep(self, older_than: float) -> int:
        with self.db.transaction() as c:
            return c.execute("DELETE FROM responses WHERE created_at < ?", (older_than,)).rowcount
