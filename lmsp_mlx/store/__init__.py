"""Durable state in one SQLite file: stored responses, tasks with their event logs, and
idempotency keys (lmsp_mlx/store/db.py has the schema)."""

from .db import Database, StoreError, StoreUnavailable
from .keys import IdempotencyKeys
from .responses import StoredResponses
from .tasks import Framing, StoredEvent, TaskLog, TaskRecord

__all__ = ["Database", "StoreError", "StoreUnavailable", "Framing", "IdempotencyKeys", "StoredResponses", "StoredEvent", "TaskLog",
           "TaskRecord"]
