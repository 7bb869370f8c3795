"""What the service's functions share, passed to each explicitly: the engine (which owns
the model), the store, tasks, tokens and settings. One `ServerState` per app."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.worker import Engine
from ..store import StoredResponses
from .auth import Tokens
from .compaction import Histories
from .run import ResponseRun
from .sealing import Sealer
from .tasks import Tasks


@dataclass(frozen=True)
class ServerSettings:
    prefill_step: int = 256
    max_body_bytes: int = 16 * 1024 * 1024
    store_retention: float = 30 * 86400.0  # seconds a stored response or task is kept
    event_retention: float = 3600.0  # seconds a task's events stay replayable after it ended
    sse_keepalive: float = 15.0  # seconds of silence on an event stream before a comment line keeps it open
    cors_origins: tuple[str, ...] = ()  # web pages besides loopback ones that may call it (lmsp_mlx/http/origins.py)
    # Render Claude Code's per-request billing line (protocol/messages.py) as the peers do,
    # which makes every prompt differ from its first line: for measuring what it costs.
    keep_billing_header: bool = False


@dataclass(frozen=True)
class RunningResponse:
    """A response to be stored that is still running, and the owner it will be stored under."""

    owner: str
    run: ResponseRun


@dataclass
class ServerState:
    engine: Engine
    settings: ServerSettings
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
