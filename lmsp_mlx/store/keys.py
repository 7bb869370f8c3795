"""Idempotency keys: a retried POST with the same key and body never generates twice.

A key maps to the task that its first request started (plain responses with a key run as
tasks too, so a retry can wait for or re-attach to them). Keys are per owner (token) and
kept for `KEY_TTL` seconds."""

from __future__ import annotations

import hashlib

from .db import Database, now

KEY_TTL = 24 * 3600.0


def body_hash(route: str, body: bytes) -> str:
    return hashlib.sha256(route.encode() + b"\0" + body).hexdigest()


class IdempotencyKeys:
    def __init__(self, db: Database) -> None:
        self.db = db

    def find(self, owner: str, key: str) -> tuple[str, str] | None:
        """(body hash, task id) that an unexpired `key` of this owner is bound to."""
        rows = self.db.query(
            "SELECT body_hash, task_id FROM idempotency_keys WHERE owner = ? AND key = ? AND created_at >= ?",
            (owner, key, now() - KEY_TTL),
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def bind(self, owner: str, key: str, digest: str, task_id: str) -> None:
        with self.db.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO idempotency_keys (owner, key, body_hash, task_id, created_at) VALUES (?, ?, ?, ?, ?)",
                (owner, key, digest, task_id, now()),
            )

    def sweep(self) -> int:
        with self.db.transaction() as c:
            return c.execute("DELETE FROM idempotency_keys WHERE created_at < ?", (now() - KEY_TTL,)).rowcount
