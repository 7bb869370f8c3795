"""What the service's functions share, passed to each explicitly: the engine (which owns
the model), the store, tasks, tokens and settings. One `ServerState` per app, made by
service/lifecycle.py's `open_state`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.worker import Engine
from ..settings import Settings
from ..store import StoredResponses
from .auth import Tokens
from .compaction import Histories
from .run import ResponseRun
from .sealing import Sealer
from .tasks import Tasks


@dataclass(frozen=True)
class RunningResponse:
    """A response to be stored that is still running, and the owner it will be stored under."""

    owner: str
    run: ResponseRun


@dataclass
class ServerState:
    engine: Engine
    settings: Settings  # its engine part with the backend's sizes filled in (serve.build)
    tokens: Tokens
    responses: StoredResponses
    tasks: Tasks
    sealer: Sealer  # state handed to clients opaque: reasoning, compaction
    histories: Histories = field(default_factory=Histories)  # conversations compacted by this process
    # Responses to be stored that are still running, by id. GET finds them here until they
    # are kept (service/responses.py).
    running: dict[str, RunningResponse] = field(default_factory=dict)
    http_statuses: dict[int, int] = field(default_factory=dict)  # HTTP replies by status, for /metrics
    noticed: set[str] = field(default_factory=set)  # what the log told once per process

    def notice_once(self, key: str) -> bool:
        """True the first time `key` is asked for: its log line is then written."""
        if key in self.noticed:
            return False
        self.noticed.add(key)
        return True
