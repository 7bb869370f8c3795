"""Tasks: responses that run in the background and whose events can be resumed (section 6.4).

A `LiveTask` drives one `ResponseRun` through its event stream whether or not anyone
listens, keeps its events in memory for followers and writes them to the store in batches
(every `FLUSH_EVERY` events or `FLUSH_SECONDS`, whichever comes first, a quiet stream's
too: one SQLite commit per token would tax the decode rate). The last batch and the task's
end are one write. A crash can lose the last batch: the final event a restart adds is
numbered past it (Tasks.recover), so ids stay unique and increasing, with a gap.
Followers replay from memory while the task lives, from the store after it ended.

Plain responses sent with an `Idempotency-Key` run as tasks too: a retry then waits for,
or re-attaches to, the work the first request started instead of generating again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..protocol.ids import new_id
from ..protocol.item_events import DELTA_EVENTS, TEXT_FIELD
from ..protocol.problems import Problem
from ..protocol.requests import ResponsesRequest, parse_request
from ..protocol.responses import ResponseObject, v1_response
from ..store import Framing, IdempotencyKeys, StoredEvent, StoredResponses, TaskLog, TaskRecord
from ..store.keys import body_hash
from ..protocol.sse import SseEvent
from .run import ResponseRun

log = logging.getLogger("lmsp_mlx.server")

FLUSH_EVERY = 64
FLUSH_SECONDS = 0.25
CANCEL_WAIT_S = 5.0


def _stored(e: SseEvent) -> StoredEvent:
    return StoredEvent(e.id, e.event, e.data)


def output_of(events: list[StoredEvent]) -> list[dict]:
    """The output items a task's stored events had streamed: what a client following them
    saw, for the final response of a task the last process left unfinished. Read from
    either framing: /v1's items carry more fields, and a call's `namespace` apart."""
    items: dict[int, dict] = {}
    for e in events:
        i = e.data.get("output_index")
        if e.event in ("response.output_item.added", "response.output_item.done"):
            item = dict(e.data["item"])
            if "namespace" in item:
                item["name"] = f"{item.pop('namespace')}.{item['name']}"
            items[i] = item
        elif e.event in DELTA_EVENTS and i in items:
            _extend(items[i], TEXT_FIELD[items[i]["type"]], e.data["delta"])
    return [items[i] for i in sorted(items)]


_PART = {"content": "output_text", "summary": "summary_text"}  # fields whose text is in one part


def _extend(item: dict, field: str, delta: str) -> None:
    if field in _PART:
        parts = item.setdefault(field, [])
        parts[:] = [{"type": _PART[field], "text": (parts[0]["text"] if parts else "") + delta}]
    else:
        item[field] = item.get(field, "") + delta


def failed_event(framing: Framing, n: int, response: ResponseObject, request: ResponsesRequest) -> SseEvent:
    """Event `n`, the final one of a task that failed outside its run (a bug, a restart),
    in the shape its followers read: LMSP's, or Open Responses' with the whole response."""
    if framing == "v1":
        return SseEvent(n, "response.failed", {"type": "response.failed", "sequence_number": n - 1,
                                               "response": v1_response(response, request, None)})
    return SseEvent(n, "response.failed", {"type": "response.failed", "sequence_number": n,
                                           "response_id": response.id, "status": "failed", "error": response.error})


class LiveTask:
    def __init__(self, task_id: str, owner: str, run: ResponseRun, log_: TaskLog, framing: Framing = "lmsp") -> None:
        self.id = task_id
        self.owner = owner
        self.run = run
        self.framing = framing
        self.created_at = time.time()
        self.events: list[SseEvent] = []
        self.done = False
        self._log = log_
        self._changed = asyncio.Condition()

    @property
    def status(self) -> str:
        if self.done or self.run.status != "in_progress":
            return self.run.status
        return "queued" if self.run.waiting else "in_progress"

    async def drive(self, stream: AsyncIterator[SseEvent]) -> None:
        """Run to the end, recording every event; never raises (a bug fails the task)."""
        pending: list[StoredEvent] = []
        flushed = time.monotonic()
        events, following = aiter(stream), None
        try:
            while True:
                following = asyncio.ensure_future(anext(events))
                # A stream gone quiet (a queued run, a long prefill) has its events stored
                # all the same within FLUSH_SECONDS: a crash loses no more than that.
                if pending and not (await asyncio.wait({following}, timeout=FLUSH_SECONDS))[0]:
                    await asyncio.to_thread(self._log.append, self.id, pending)
                    pending, flushed = [], time.monotonic()
                try:
                    event = await following
                except StopAsyncIteration:
                    break
                self.events.append(event)
                pending.append(_stored(event))
                async with self._changed:
                    self._changed.notify_all()
                if len(pending) >= FLUSH_EVERY or time.monotonic() - flushed >= FLUSH_SECONDS:
                    await asyncio.to_thread(self._log.append, self.id, pending)
                    pending, flushed = [], time.monotonic()
        except Exception:
            log.exception("task %s failed", self.id)
            self.run.status = "failed"
            self.run.error = Problem("internal_error", "the task failed inside the service")
            final = failed_event(self.framing, len(self.events) + 1, self.run.response(), self.run.req)
            self.events.append(final)  # followers still get exactly one final event
            pending.append(_stored(final))
            if following is not None and not following.done():  # the store failed: stop the run too
                following.cancel()
        response = self.run.response().model_dump(mode="json")
        try:
            await asyncio.to_thread(self._log.append, self.id, pending, self.run.status, response)
        except Exception:
            log.exception("task %s: its end could not be stored", self.id)
        self.done = True
        async with self._changed:
            self._changed.notify_all()

    async def follow(self, after: int) -> AsyncIterator[SseEvent]:
        """Events with an id above `after` (ids are positions + 1), then the live ones until
        the final event."""
        i = after
        while True:
            while i < len(self.events):
                i += 1
                yield self.events[i - 1]
            if self.done:
                return
            async with self._changed:
                await self._changed.wait_for(lambda: self.done or len(self.events) > i)

    async def wait(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.done)

    async def cancel(self) -> None:
        """Stop it and wait (bounded) for its end, so the reply can say `cancelled`: the
        worker stops within a decode step or prefill chunk, a queued job at once."""
        self.run.cancel()
        try:
            await asyncio.wait_for(self.wait(), CANCEL_WAIT_S)
        except asyncio.TimeoutError:
            pass


@dataclass
class Submitted:
    task_id: str
    replayed: bool


class Tasks:
    """The live tasks of this process, over the store's task log and idempotency keys."""

    def __init__(self, log_: TaskLog, keys: IdempotencyKeys) -> None:
        self.log = log_
        self.keys = keys
        self.live: dict[str, LiveTask] = {}
        self._drivers: set[asyncio.Task] = set()
        self._key_locks: dict[tuple[str, str], list] = {}  # (owner, key) -> [lock, users]

    def start(self, owner: str, run: ResponseRun, stream: AsyncIterator[SseEvent], framing: Framing = "lmsp") -> LiveTask:
        """Record a task for an already queued run and drive it in the background."""
        task = LiveTask(new_id("task"), owner, run, self.log, framing)
        self.log.create(task.id, owner, run.id, run.stored_request(), framing)
        self.live[task.id] = task
        driver = asyncio.create_task(task.drive(stream), name=task.id)
        self._drivers.add(driver)

        def ended(t: asyncio.Task) -> None:
            self._drivers.discard(t)
            self.live.pop(task.id, None)

        driver.add_done_callback(ended)
        return task

    async def start_once(self, owner: str, key: str | None, route: str, body: object, start) -> Submitted:
        """`start()` (-> LiveTask) unless `key` already names work of this owner: then that
        work, if the body is the same, or 422 `idempotency_key_reused`."""
        if key is None:
            return Submitted((await start()).id, replayed=False)
        if not 1 <= len(key) <= 255:
            raise Problem("invalid_request", "Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key")
        digest = body_hash(route, json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
        slot = self._key_locks.setdefault((owner, key), [asyncio.Lock(), 0])
        slot[1] += 1  # requests holding or waiting for this key's lock
        try:
            async with slot[0]:  # a concurrent duplicate waits here, then finds the first one's task
                bound = await asyncio.to_thread(self.keys.find, owner, key)
                if bound is not None:
                    if bound[0] != digest:
                        raise Problem("idempotency_key_reused",
                                      "this Idempotency-Key was used with a different request body",
                                      param="Idempotency-Key")
                    return Submitted(bound[1], replayed=True)
                task = await start()
                await asyncio.to_thread(self.keys.bind, owner, key, digest, task.id)
                return Submitted(task.id, replayed=False)
        finally:
            slot[1] -= 1
            if slot[1] == 0:
                del self._key_locks[(owner, key)]

    def record(self, owner: str, task_id: str) -> TaskRecord | None:
        return self.log.get(owner, task_id)

    async def events(self, owner: str, task_id: str, after: int) -> AsyncIterator[SseEvent]:
        """Events after `after`: live ones while the task runs, stored ones after it ended.
        404 `task_not_found`, 410 `event_history_expired` (both raised before any event)."""
        task = self.live.get(task_id)
        if task is not None and task.owner == owner:
            return task.follow(after)
        record = await asyncio.to_thread(self.log.get, owner, task_id)
        if record is None:
            raise Problem("task_not_found", f"no task {task_id!r}")
        if record.events_expired:
            raise Problem("event_history_expired",
                          f"the events of task {task_id!r} are past their retention; GET /lmsp/v1/tasks/{task_id} "
                          "has its final result")
        stored = await asyncio.to_thread(self.log.events_after, task_id, after)

        async def replay() -> AsyncIterator[SseEvent]:
            for e in stored:
                yield SseEvent(e.id, e.event, e.data)

        return replay()

    def recover(self, responses: StoredResponses) -> int:
        """At start: tasks the last process left running end `failed` with a final event;
        a stored one's response is kept failed too (a /v1 background client polls it)."""
        records = self.log.unfinished()
        for r in records:
            error = Problem("internal_error", "the service restarted while this task was running").document()
            output = output_of(self.log.events_after(r.id, 0))
            response = {"id": r.response_id, "object": "response", "created_at": int(r.created_at),
                        "status": "failed", "model": r.request.get("model"), "output": output,
                        "usage": None, "error": error, "incomplete_details": None}
            # Events go to followers before their batch is stored: the last process may have
            # sent up to FLUSH_EVERY more than the store holds. The final event's id goes past
            # them all, so a follower resuming after any event it was sent still gets it.
            final = failed_event(r.framing, r.last_event_id + FLUSH_EVERY + 1, ResponseObject.model_validate(response),
                                 parse_request(r.request))
            self.log.append(r.id, [_stored(final)], "failed", response)
            if r.request.get("store"):
                responses.put(r.owner, r.request, response, int(time.time()))
        if records:
            log.warning("%d task(s) were running when the service stopped: marked failed", len(records))
        return len(records)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Wait (bounded) for the drivers to record their tasks' ends after the engine cancelled them."""
        if self._drivers:
            await asyncio.wait(list(self._drivers), timeout=timeout)
