"""The service's life around serving: what happens before the first request and after the last.

- `open_state` makes the app's one `ServerState` over a started engine and an open store,
  and first recovers what a previous process left running: its tasks and stored responses
  end `failed` (never silently lost, never still "running" for ever), before any request
  can ask for them.
- `Lifecycle.begin`, on the serving event loop, starts the retention sweeper and the
  engine's idle clocks; `Lifecycle.end` stops the sweeper and waits (bounded) for tasks and
  stored responses to record how they ended, so a shutdown keeps what it cut.

The HTTP layer calls `begin` and `end` from its app's serving hooks and knows nothing else
of this.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..engine.worker import Engine
from ..protocol.problems import Problem
from ..settings import Settings, StoreSettings
from ..store import Database, IdempotencyKeys, StoredResponses, TaskLog
from .auth import Tokens
from .sealing import Sealer
from .state import ServerState
from .tasks import Tasks

log = logging.getLogger("lmsp_mlx.server")

RECORD_ENDS_WITHIN = 10.0  # seconds a shutdown waits for running stored responses to be kept


def open_state(engine: Engine, settings: Settings, tokens: Tokens, db: Database, state_key: bytes) -> ServerState:
    """The server's state over `db`, after the last process's unfinished work was marked failed.
    `state_key` seals the state clients carry (service/sealing.py)."""
    tasks = Tasks(TaskLog(db), IdempotencyKeys(db))
    stored = StoredResponses(db)
    tasks.recover(stored)
    lost = stored.recover(Problem("internal_error", "the service stopped while this response was running").document())
    if lost:
        log.warning("%d stored response(s) were running when the service stopped: marked failed", lost)
    return ServerState(engine, settings, tokens, stored, tasks, Sealer(state_key, ""))  # each run's: Sealer.for_model


class Lifecycle:
    """Starts and stops what runs beside the requests: the retention sweeper, and the waits of a shutdown."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._sweeper: asyncio.Task | None = None

    async def begin(self) -> None:
        """On the serving loop, before the first request."""
        self.state.engine.begin_serving()
        self._sweeper = asyncio.create_task(sweep_forever(self.state.settings.store, self.state.responses,
                                                          self.state.tasks))

    async def end(self) -> None:
        """After the last request: the sweeper stops, then tasks and stored responses still
        running (their streams were ended by the shutdown) are kept as they ended."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.state.tasks.shutdown()
        running = [r.run.ended() for r in list(self.state.running.values())]
        if running:
            await asyncio.wait([asyncio.ensure_future(r) for r in running], timeout=RECORD_ENDS_WITHIN)


async def sweep_forever(settings: StoreSettings, stored: StoredResponses, tasks: Tasks) -> None:
    """Delete what is past retention every `settings.sweep_period` seconds; a failed sweep is logged and retried."""
    while True:
        try:
            await sweep_once(settings, stored, tasks, time.time())
        except Exception:
            log.exception("store sweep failed")
        await asyncio.sleep(settings.sweep_period)


async def sweep_once(settings: StoreSettings, stored: StoredResponses, tasks: Tasks, now: float) -> None:
    gone = await asyncio.to_thread(stored.sweep, now - settings.retention)
    logs, old = await asyncio.to_thread(tasks.log.sweep, now - settings.event_retention, now - settings.retention)
    keys = await asyncio.to_thread(tasks.keys.sweep)
    if gone or logs or old or keys:
        log.info("store sweep: %d responses, %d task event logs, %d tasks, %d idempotency keys removed",
                 gone, logs, old, keys)
