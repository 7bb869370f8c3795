"""The one worker thread that owns the loaded models.

The models' KV sessions live on this thread only. Each loaded model is a `ModelSlot`
(engine/slot.py), loaded at start or on demand off this thread and unloaded by it, once
none of its jobs runs (engine/models.py decides which). The worker serves up to
`max_batch` jobs at once, each a `Sequence` on its own KV session of its model's pool,
picked by the pool's lookup order (lmsp_mlx/cache). The loop runs in steps: jobs waiting
join at a step boundary, the clients that left are dropped, and each model's batch in turn
runs one prompt chunk, then one decode step for every sequence that waits for a token
(engine/batch.py); a batch never mixes models. A job that
arrives while the batch is full waits in the bounded queue; beyond it, `QueueFull`.

Requests talk to it through `Job`s: the queue in, an asyncio queue of `GenerationEvent`s
out (handed over with `call_soon_threadsafe`). On stop every sequence ends cancelled and
the resident sessions are checkpointed. Other MLX work on a loaded model (embeddings) runs
on this thread too, between two steps, through `Engine.call`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, TypeVar

import mlx.core as mx

from ..cache.pool import CacheSource, Start
from ..protocol.auth import LOCAL_OWNER
from ..protocol.routes import Route
from .events import Failed, Finished, GenerationEvent, TextDelta, Usage
from .batch import chunk_size, next_prefill, prefill_group
from .catalog import Catalog
from .generate import GenerationParams
from .loader import LoadedModel
from ..cache.heap import HeapTrimmer
from .models import ModelSet
from ..settings import CacheSettings, EngineSettings, SpeculateMode
from .admission import HostGrowth, MemoryFigures, MemoryGate, cache_limit, out_of_memory
from .footprint import budget_bytes, gb
from .slot import ModelSlot, ModelSpec, SlotState, close_slot, footprint, open_slot
from .sequence import Phase, Sequence
from .constrain import Constraint
from .lockstep import JobSpec, Lockstep, Tick, spec_of
from .speculate import DraftModel, Drafting
from .turn import Conversation, TurnOutput

log = logging.getLogger("lmsp_mlx.engine")


class KVTooBig(Exception):
    """The request's KV could never fit the memory budget, even alone (engine/admission.py)."""


class QueueFull(Exception):
    """`--max-queue` requests already wait for the batch. `retry_after`: about when a slot
    frees, in seconds (the recent time per request); the HTTP layer answers 429 with it."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"{waiting} request{' is' if waiting == 1 else 's are'} already waiting for the model; "
                         f"retry in about {retry_after} s")
        self.waiting = waiting
        self.retry_after = retry_after


@dataclass(eq=False)  # compared by identity (Engine.withdraw finds it in the queue)
class Job:
    params: GenerationParams
    route: Route
    loop: asyncio.AbstractEventLoop | None  # None: a mirror of rank 0's job on another rank (its events go nowhere)
    slot: ModelSlot  # the model it runs on, leased by its run until it ended
    text: str = ""  # the rendered prompt: what text-prefix lookups compare
    visible: str | None = None  # the prompt as a visible-only replay renders, where `text` reveals hidden reasoning
    keep_history: str | None = None  # a compaction: checkpoint the KV of this leading part of `text`
    conv: Conversation | None = None  # the items behind the prompt: for the turn's visible transcript
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: bool = False  # the worker took it from the queue (a task is then `in_progress`)
    kv_need: int = 0  # its KV grown to its limit, reserved while it runs (engine/admission.py)
    # The prompt tokens its KV lookup found cached, set before its first event goes out (so a
    # reader of that event sees it): what Anthropic's message_start reports.
    cached: int | None = None
    ended: bool = False  # its ending event is out (from the worker, or abandon())
    id: int = 0  # under lockstep (engine/lockstep.py): its number on every rank
    _cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: GenerationEvent) -> None:
        if isinstance(event, (Finished, Failed)):
            self.ended = True
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            self.cancel()

    def cancel(self) -> None:
        self._cancel.set()

    def abandon(self) -> None:
        """Shutdown, on the event loop: end the stream as cancelled now, without waiting for
        the worker to reach its next step (a long prefill chunk); what it emits later
        goes unread."""
        self.cancel()
        if not self.ended:
            self.ended = True
            self.events.put_nowait(Finished("cancelled", Usage(len(self.params.prompt), 0)))

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def stream(self):
        """Yield events until the ending one (`Finished` or `Failed`), inclusive."""
        while True:
            event = await self.events.get()
            yield event
            if isinstance(event, (Finished, Failed)):
                return


@dataclass(eq=False)
class Running:
    """A job the worker has taken: its session's start, its sequence and its turn."""

    job: Job
    start: Start
    seq: Sequence
    turn: TurnOutput
    began: float


# Finished.reason -> the response status clients see, used in logs and metrics.
_STATUS = {"stop": "completed", "complete": "completed", "length": "incomplete", "cancelled": "cancelled"}


@dataclass
class Counters:
    """What /metrics reports; written by the worker thread, and by the event loop for a
    job withdrawn from the queue (hence the lock)."""

    requests: dict[str, int] = field(default_factory=dict)  # by final status
    prompt_tokens: int = 0
    output_tokens: int = 0
    kv_sessions: int = 0  # resident in the session pool (running ones included), after the last sequence ended
    kv_bytes: int = 0  # their KV arrays and snapshots
    lookups: dict[CacheSource, int] = field(default_factory=dict)  # where each request's KV came from
    live_continuations: int = 0  # requests of tool outputs alone that continued a live turn by call id
    drafted: dict[SpeculateMode, int] = field(default_factory=dict)  # speculative tokens drafted, by drafter
    accepted: dict[SpeculateMode, int] = field(default_factory=dict)  # ... and of those, accepted
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine at one instant, for /metrics (http/metrics.py): the queue and batch, the
    loaded models, the counters (copied under their lock, so they agree with each other),
    the resident KV sessions as the worker last counted them, and MLX's allocator, whose
    cache keeps freed buffers for reuse."""

    queue_depth: int
    busy: bool
    batch_sequences: int
    batch_max: int
    models_loaded: int
    requests: dict[str, int]  # generations by final status
    prompt_tokens: int
    output_tokens: int
    lookups: dict[CacheSource, int]
    live_continuations: int
    drafted: dict[SpeculateMode, int]
    accepted: dict[SpeculateMode, int]
    kv_sessions: int
    kv_bytes: int
    mlx_active_bytes: int
    mlx_cache_bytes: int
    memory: MemoryFigures = field(default_factory=MemoryFigures)  # the memory budget and what is held against it
    ranks: int = 1  # the processes the model is split over (engine/distributed.py); this one is rank 0
    rank_memory: tuple[int, ...] = ()  # each rank's MLX active memory at its last reading (engine/lockstep.py)


_WAKE = object()  # in the job queue: the worker has control work (an unload, a call), not a job
T = TypeVar("T")
# Seconds between the ticks of idle ranks. A rank that waits in a collective spins a core
# (MLX's ring backend polls), so idle ranks do not wait in one: rank 0 waits this long for a
# job, the others sleep it. A request that arrives while they sleep waits at most this.
IDLE_TICK = 0.25


class Engine:
    def __init__(self, catalog: Catalog, settings: EngineSettings, cache: CacheSettings = CacheSettings(),
                 lockstep: Lockstep | None = None):
        """`settings` has its backend's sizes filled in (EngineSettings.for_backend). With
        `lockstep`, the model is split over ranks and this worker steps with theirs."""
        assert settings.max_batch is not None, "EngineSettings.for_backend fills max_batch in"
        self.catalog = catalog
        self.settings = settings
        self._cache_settings = cache
        self.models: ModelSet | None = None  # the loaded models: the event loop's (start)
        self._loads = threading.Lock()  # one model loads at a time: each checked against the memory left
        self._control: list[tuple[ModelSlot, asyncio.AbstractEventLoop, asyncio.Future]] = []  # unloads for the worker
        self._control_lock = threading.Lock()
        self._calls: list[tuple[Callable[[], object], asyncio.AbstractEventLoop, asyncio.Future]] = []  # Engine.call
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=settings.max_queue)
        self.counters = Counters()
        self.max_batch = settings.max_batch
        self._active: list[Running] = []  # the worker thread's; others only read a copy
        self._held: list[Job] = []  # taken from the queue, waiting for memory (engine/admission.py), in arrival order
        self.gate: MemoryGate | None = None  # set at start, with the memory budget
        self._job_seconds = 1.0  # a moving average of the time a job holds the worker (for Retry-After)
        self._trim_heap = HeapTrimmer()  # after steps, at most every second: see cache/heap.py
        self._lockstep = lockstep
        self._agreed_cancels: set[int] = set()  # under lockstep: the job ids this step ends cancelled
        self._idle = False  # under lockstep: the last tick brought nothing and nothing runs
        self.lost: str | None = None  # under lockstep: why the ranks can no longer step together
        self.on_lost: Callable[[], None] | None = None  # called once `lost` is set: serve.py exits
        self._beat = time.monotonic()  # under lockstep: when the worker last began a step (the watchdog reads it)
        self._ended = threading.Event()  # the worker returned, or the ranks were lost
        self._thread = threading.Thread(target=self._run, name="lmsp-worker", daemon=True)

    def start(self) -> LoadedModel:
        """Load the default model and the pinned ones (or raise why not), then start the worker."""
        first = None
        budget, source = budget_bytes(self.settings.memory_budget_bytes)
        host, counts_host = HostGrowth(), budget is not None and self.settings.memory_budget_scope == "process"
        self.gate = MemoryGate(budget, source, lambda: sum(s.size_bytes for s in list(self.models.slots.values())),
                               host=host if counts_host else lambda: 0)
        if budget is not None:
            mx.set_cache_limit(cache_limit(budget))
        self.models = ModelSet(self.catalog.find, self._load, self._retire, max_loaded=self.settings.max_loaded_models,
                               keep_alive=self.settings.keep_alive, budget=budget, budget_source=source)
        for spec in self.catalog.named:
            if spec is not self.catalog.named[0] and not spec.pinned:
                continue
            slot = ModelSlot(spec)
            self._open(slot)
            slot.state = SlotState.READY
            slot.last_used = time.monotonic()
            self.models.adopt(slot)
            first = first or slot.lm
        if counts_host:
            host.start()  # the runtime's own, with the first models loaded
        self._thread.start()
        return first

    @property
    def default_id(self) -> str:
        return self.catalog.default_id

    def _open(self, slot: ModelSlot) -> None:
        with self._loads:
            if slot.size_bytes == 0:
                slot.size_bytes = footprint(slot.spec)
            open_slot(slot, ctx=self.settings.ctx, cache=self._cache_settings,
                      max_output_tokens=self.settings.max_output_tokens, copy_room=self._copy_fits)
        log.info("batch for %s: up to %d sequences decode together (--max-batch)", slot.id, self.max_batch)

    async def _load(self, slot: ModelSlot) -> None:
        await asyncio.to_thread(self._open, slot)

    async def _retire(self, slot: ModelSlot) -> None:
        """Have the worker checkpoint the slot's sessions and drop it, once none of its jobs runs."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._control_lock:
            self._control.append((slot, loop, done))
        try:
            self._jobs.put_nowait(_WAKE)
        except queue.Full:  # the worker is busy and reads the control list at its next step anyway
            pass
        await done

    @property
    def distributed(self) -> bool:
        """The model is split over ranks: only the lockstep's own work runs on it."""
        return self._lockstep is not None

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the worker thread between two steps, and give back what it returns
        or raise what it raises: MLX work on a loaded model outside the batch (embeddings)
        must not run beside a step on another thread."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._control_lock:
            self._calls.append((fn, loop, done))
        try:
            self._jobs.put_nowait(_WAKE)
        except queue.Full:  # the worker is busy and runs the calls before its next step anyway
            pass
        return await done

    def _run_calls(self) -> None:
        with self._control_lock:
            calls, self._calls = self._calls, []
        for fn, loop, done in calls:
            try:
                result, error = fn(), None
            except Exception as exc:  # the caller's to report; the worker goes on
                result, error = None, exc

            def settle(d=done, r=result, e=error) -> None:
                if d.done():
                    return
                d.set_exception(e) if e is not None else d.set_result(r)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop has closed
                pass

    def listing(self) -> list[tuple[ModelSpec, ModelSlot | None]]:
        """Every model it can serve (engine/catalog.py), with its slot where it is loaded or
        loading. Reads the model store and the Hugging Face cache: call it off the event loop."""
        slots = dict(self.models.slots)
        found = [ModelSpec(m.id, m.path, self.catalog.options) for m in self.catalog.listed()]
        specs = [*self.catalog.named, *found]
        gone = [s.spec for s in slots.values() if s.spec not in specs]  # removed from disk: serves until unloaded
        return [(spec, slots.get(spec.id)) for spec in specs + gone]

    def begin_serving(self) -> None:
        """On the serving event loop: idle unloads (--keep-alive) count from now."""
        self.models.begin()

    async def unload(self, model_id: str) -> bool:
        return await self.models.unload(model_id)

    async def acquire(self, model_id: str) -> ModelSlot:
        """The model's slot (an alias resolved), loaded on demand (engine/models.py); `release`
        it when its run has ended."""
        return await self.models.acquire(self.catalog.resolve(model_id))

    def release(self, slot: ModelSlot) -> None:
        self.models.release(slot)

    def _jobs_now(self) -> list[Job]:
        """The running jobs, then the waiting ones (for memory, then in the queue)."""
        with self._jobs.mutex:
            waiting = [j for j in self._jobs.queue if isinstance(j, Job)]
        return [r.job for r in list(self._active)] + list(self._held) + waiting

    def cancel_all(self) -> None:
        """Shutdown: the running sequences stop at the next step, waiting ones end as they are taken."""
        for job in self._jobs_now():
            job.cancel()

    def abandon_all(self) -> None:
        """Shutdown: end every job's stream now (Job.abandon), the running ones included."""
        for job in self._jobs_now():
            job.abandon()

    def stop(self) -> None:
        """Cancel everything and end the worker thread (not where the ranks were lost: it may
        be blocked in a collective for ever, and the process exits around it)."""
        if not self._thread.is_alive() or self.lost is not None:
            return
        self.cancel_all()
        self._jobs.put(None)
        self._ended.wait(timeout=300)  # it checkpoints the resident sessions before ending (or the ranks are lost)

    def withdraw(self, job: Job) -> bool:
        """End a cancelled job that is still waiting now, off the queue, so its client hears
        `cancelled` without waiting for the jobs ahead of it. False when the worker has it
        (it stops at its next step) or it has ended."""
        with self._jobs.mutex:
            try:
                self._jobs.queue.remove(job)
            except ValueError:
                return False
            self._jobs.not_full.notify()
        n = len(job.params.prompt)
        self._log(job, job.slot.lm, "cancelled", Usage(n, 0), 0.0, 0.0, f" prefilled=0/{n} withdrawn from the queue")
        job.emit(Finished("cancelled", Usage(n, 0)))
        return True

    @property
    def queued(self) -> int:
        """Jobs waiting: in the queue, and taken from it to wait for memory."""
        return self._jobs.qsize() + len(self._held)

    @property
    def running(self) -> int:
        """Sequences in the batch now."""
        return len(self._active)

    def snapshot(self) -> EngineSnapshot:
        c = self.counters
        loaded = sum(self.models.loaded(m) for m in list(self.models.slots))
        with c.lock:
            return EngineSnapshot(
                queue_depth=self.queued, busy=self.busy, batch_sequences=self.running, batch_max=self.max_batch,
                models_loaded=loaded, requests=dict(c.requests), prompt_tokens=c.prompt_tokens,
                output_tokens=c.output_tokens, lookups=dict(c.lookups), live_continuations=c.live_continuations,
                drafted=dict(c.drafted), accepted=dict(c.accepted),
                kv_sessions=c.kv_sessions, kv_bytes=c.kv_bytes, mlx_active_bytes=mx.get_active_memory(),
                mlx_cache_bytes=mx.get_cache_memory(),
                memory=replace(self.gate.figures) if self.gate is not None else MemoryFigures(),
                ranks=self._lockstep.ranks.size if self._lockstep is not None else 1,
                rank_memory=tuple(self._lockstep.memory) if self._lockstep is not None else ())

    @property
    def settle_seconds(self) -> float:
        """How long a shutdown waits for the running steps to end on their own."""
        return self.settings.rank_timeout + 2 if self._lockstep is not None else 1.0

    @property
    def busy(self) -> bool:
        return bool(self._active)

    def behind_another(self, job: Job) -> bool:
        """`job` waits for a slot in the batch: queued, as clients see it (not the instant
        between its submission and the worker taking it into a batch with room)."""
        if job.started:
            return False
        with self._jobs.mutex:
            try:
                ahead = list(self._jobs.queue).index(job)
            except ValueError:
                return False
        return len(self._active) + ahead >= self.max_batch

    def memory_room(self, slot: ModelSlot, prompt_tokens: int, room: int) -> int:
        """`room` output tokens, fewer where the memory budget holds fewer beside the weights
        (for a request that sets no output limit: it gets what fits, not a 507)."""
        fits = self.gate.output_room(slot, prompt_tokens) if self.gate is not None else None
        if fits is None or fits >= room or fits < 1:
            return room
        log.info("memory: a request with no output limit may write up to %d tokens (the memory budget's room "
                 "beside %s's weights; the context would allow %d)", fits, slot.id, room)
        return fits

    def submit(self, slot: ModelSlot, params: GenerationParams, route: Route, text: str = "",
               conv: Conversation | None = None, visible: str | None = None, keep_history: str | None = None) -> Job:
        """Queue a job; QueueFull where --max-queue jobs wait, KVTooBig where its KV could
        never fit the memory budget (engine/admission.py)."""
        if self.gate is not None and (why := self.gate.too_big(slot, len(params.prompt), params.max_tokens)):
            raise KVTooBig(why)
        job = Job(params=params, route=route, loop=asyncio.get_running_loop(), slot=slot, text=text, conv=conv,
                  visible=visible, keep_history=keep_history,
                  kv_need=MemoryGate.need(slot, len(params.prompt), params.max_tokens))
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            # A slot frees when the running job ends: about the recent time per job.
            raise QueueFull(self._jobs.maxsize, max(1, math.ceil(self._job_seconds))) from None
        return job

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._ended.set()

    def _loop(self) -> None:
        stopping = False
        if self._lockstep is not None:
            threading.Thread(target=self._watch, name="lmsp-rank-watchdog", daemon=True).start()
        while not (stopping and not self._active):
            self._beat = time.monotonic()
            self._unload_retired()
            self._run_calls()
            if self._lockstep is None:
                stopping = self._join_waiting(stopping)
            else:
                try:
                    stopping = self._join_agreed(stopping)
                except Exception as exc:  # a rank died or stopped answering: nothing can step any more
                    self._lose_ranks(exc)
                    return
            try:
                self._step()
            except Exception as exc:  # a bug must fail the requests it touched, never the worker
                log.exception("a batch step failed: its sequences fail, the worker goes on")
                for run in list(self._active):
                    self._fail(run, exc)
            self._trim_heap()  # at most every second: a long prefill's freed buffers too (cache/heap.py)
        for slot in list(self.models.slots.values()):
            if slot.pool is not None:
                slot.pool.close()  # checkpoints the resident sessions
        if self._lockstep is not None:
            self._lockstep.barrier()  # every rank's shards are written before rank 0 exits

    def wait(self) -> None:
        """Until the worker ends (a rank other than 0 follows rank 0's stop) or the ranks are lost."""
        self._ended.wait()

    def _watch(self) -> None:
        """Under lockstep: a step (its collectives included) or a wait for rank 0's tick that
        takes longer than --rank-timeout means a rank stopped answering; a collective over a
        lost connection can block for ever instead of failing."""
        timeout = self.settings.rank_timeout
        while not self._ended.wait(1.0):
            if time.monotonic() - self._beat > timeout:
                self._lose_ranks(TimeoutError(f"no step together for {timeout:g} s (--rank-timeout)"))
                return

    def _join_waiting(self, stopping: bool) -> bool:
        """The waiting jobs join at this step boundary (blocking while idle), the ones that
        wait for memory first, in arrival order; True once the stop sign came."""
        self._end_cancelled_held()
        if not self._active and not self._held and not stopping:  # idle: wait for work
            if self._jobs.empty():
                self._trim_heap(idle=True)
            stopping = not self._take(self._jobs.get())
        while not stopping and len(self._active) < self.max_batch:
            if self._held:
                if not self._fits(self._held[0]):
                    break  # the first in line waits for a running sequence to end; none overtakes it
                stopping = not self._admit(self._held.pop(0))
                continue
            try:
                stopping = not self._take(self._jobs.get_nowait())
            except queue.Empty:
                break
        return stopping

    def _take(self, job: Job | None) -> bool:
        """`_admit` a job from the queue, or hold it until its KV fits the memory budget."""
        if isinstance(job, Job) and not job.cancelled and not self._fits(job):
            self._hold(job)
            return True
        return self._admit(job)

    def _hold(self, job: Job) -> None:
        """The job waits for memory, first in line (none is taken from the queue meanwhile)."""
        self._held.append(job)
        self.gate.figures.waits += 1
        f = self.gate.figures
        log.info("memory: a request waits for memory (its KV grows to %s; %d running reserve %s; "
                 "resident sessions %s; host growth %s)", gb(job.kv_need), len(self._active),
                 gb(f.kv_reserved), gb(f.kv_resident), gb(f.host))

    def _pools(self) -> list:
        """The loaded models' session pools (what the memory budget counts besides the weights)."""
        return [s.pool for s in list(self.models.slots.values()) if s.pool is not None]

    def _fits(self, job: Job, joining: list[Job] | None = None) -> bool:
        """Whether `job` fits beside the running jobs and those `joining` with it this step."""
        running = [r.job.kv_need for r in self._active] + [j.kv_need for j in joining or []]
        return self.gate.fits(job.kv_need, running, self._pools(), alone=not running)

    def _copy_fits(self, nbytes: int) -> bool:
        """Whether a checkpoint's host copy of `nbytes` fits the memory budget now (the worker
        thread's, as a turn ends: SessionPool.copy_room)."""
        room = self.gate.room(sum(r.job.kv_need for r in self._active), self._pools())
        return room is None or room >= nbytes

    def _end_cancelled_held(self) -> None:
        for job in [j for j in self._held if j.cancelled]:
            self._held.remove(job)
            self._end_unstarted(job)

    def _join_agreed(self, stopping: bool) -> bool:
        """Under lockstep: rank 0 takes the waiting jobs as `_join_waiting` does (idle, it
        waits at most IDLE_TICK, so that a lost rank shows while nothing runs) and shares
        them with the runs that end cancelled now; every rank then admits the same jobs."""
        lockstep = self._lockstep
        tick, joined = None, []
        if not lockstep.leads and not self._active and self._idle:
            time.sleep(IDLE_TICK)  # rank 0 waits as long for a job before its next tick
        if lockstep.leads:
            joined, stopping, shed = self._lead_joins(stopping)
            tick = Tick([spec_of(j.id, j.slot.id, j.params, j.route, j.text, j.visible, j.keep_history, j.conv)
                         for j in joined], [r.job.id for r in self._active if r.job.cancelled], stopping, shed)
        tick = lockstep.agree(tick)
        if not lockstep.leads:
            for model, sessions in tick.shed:  # the resident sessions rank 0's memory budget evicted
                self.models.slots[model].pool.shed_sessions(sessions)
            joined = [self._mirror(spec) for spec in tick.joined]
        self._agreed_cancels = set(tick.cancelled)
        for job in joined:
            self._admit(job)
        self._idle = not tick.joined and not self._active
        return tick.stop

    def _lead_joins(self, stopping: bool) -> tuple[list[Job], bool, tuple[tuple[str, int], ...]]:
        """Rank 0's part of `_join_agreed`: the jobs that join now, as `_join_waiting` takes
        them (the memory budget's waiting first, none overtaking), whether the stop sign came,
        and how many idle sessions of each model the budget evicted to make room (every rank
        evicts the same: their pools hold the same sessions in the same order). Rank 0's
        figures stand for every rank's: the ranks hold equal parts of the weights and KV."""
        self._end_cancelled_held()  # held jobs never reached the others: rank 0 ends them alone
        before = {s.id: s.pool.shed_total for s in list(self.models.slots.values()) if s.pool is not None}
        joined: list[Job] = []
        taken: list[Job | None] = []  # idle: what a wait of at most IDLE_TICK brought (None: the stop sign)
        if not self._active and not self._held and not stopping:
            try:
                taken.append(self._jobs.get(timeout=IDLE_TICK))
            except queue.Empty:
                pass
        while not stopping and len(self._active) + len(joined) < self.max_batch:
            if self._held:
                if not self._fits(self._held[0], joined):
                    break  # the first in line waits for a running sequence to end
                job = self._held.pop(0)
            else:
                try:
                    job = taken.pop() if taken else self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                if job is _WAKE:
                    continue
                if job.cancelled:  # it never started: rank 0 ends it alone
                    job.started = True
                    self._end_unstarted(job)
                    continue
                if not self._fits(job, joined):
                    self._hold(job)
                    break
            job.id = self._lockstep.next_id()
            joined.append(job)
        shed = tuple((s.id, n) for s in list(self.models.slots.values()) if s.pool is not None
                     and (n := s.pool.shed_total - before.get(s.id, s.pool.shed_total)) > 0)
        return joined, stopping, shed

    def _mirror(self, spec: JobSpec) -> Job:
        """Rank 0's job on this rank: the same work, its events dropped."""
        slot = self.models.slots[spec.model]
        params = spec.params
        if spec.grammar is not None:
            params = replace(params, constraint=Constraint(slot.lm.tokenizer, spec.grammar))
        return Job(params=params, route=spec.route, loop=None, slot=slot, text=spec.text, visible=spec.visible,
                   keep_history=spec.keep_history, conv=spec.conv, id=spec.id)

    def _lose_ranks(self, exc: Exception) -> None:
        """The ranks lost each other: every request here fails now, and the process is
        told to exit (`lost`), so that a supervisor starts all ranks again."""
        if self.lost is not None:
            return
        self.lost = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        log.error("lost the other ranks (%s): failing %d running and the waiting requests, exiting",
                  self.lost, len(self._active))
        failure = Failed(f"the model's ranks stopped answering each other ({self.lost})", code="internal_error")
        for run in list(self._active):
            run.job.emit(failure)
        self._active.clear()
        for job in self._held:
            job.emit(failure)
        self._held.clear()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job):
                job.emit(failure)
        self._ended.set()
        if self.on_lost is not None:
            self.on_lost()

    def _unload_retired(self) -> None:
        """Unloads the event loop asked for (ModelSet), of models none of whose jobs runs or waits."""
        with self._control_lock:
            asked = list(self._control)
        if not asked:
            return
        with self._jobs.mutex:
            busy = {r.job.slot for r in self._active} | {j.slot for j in self._jobs.queue if isinstance(j, Job)} \
                | {j.slot for j in self._held}
        for entry in asked:
            slot, loop, done = entry
            if slot in busy:
                continue
            close_slot(slot)
            with self._control_lock:
                self._control.remove(entry)
            try:
                loop.call_soon_threadsafe(lambda d=done: d.done() or d.set_result(None))
            except RuntimeError:  # the loop has closed
                pass

    # -- one step of the batch -----------------------------------------------------------------

    def _step(self) -> None:
        """Drop the sequences whose clients left, run one prompt chunk, then one decode step
        for every sequence that waits for a token."""
        for run in [r for r in self._active if self._ends_cancelled(r.job)]:
            self._end(run, run.seq.cancel())
        # A batch holds one model's sequences: each model's gets its step in turn.
        for slot in dict.fromkeys(r.job.slot for r in self._active):
            self._step_model(slot, [r for r in self._active if r.job.slot is slot])

    def _ends_cancelled(self, job: Job) -> bool:
        """Whether `job`'s run ends cancelled at this step: its client left (under lockstep:
        rank 0 said so in this step's tick, the same step on every rank)."""
        return job.id in self._agreed_cancels if self._lockstep is not None else job.cancelled

    def _step_model(self, slot: ModelSlot, runs: list[Running]) -> None:
        chunk = min(r.job.params.prefill_step for r in runs)
        if group := prefill_group([r.seq for r in runs], chunk, slot.lm):
            slot.batch.prefill(group)  # short prompts that arrived together: one forward
        elif (seq := next_prefill([r.seq for r in runs])) is not None:
            run = next(r for r in runs if r.seq is seq)
            try:
                seq.prefill_chunk(chunk_size(seq, run.job.params.prefill_step, len(self._active) > 1))
            except Exception as exc:
                self._fail(run, exc)
            else:
                if seq.phase is Phase.DONE:
                    self._end(run, seq.result)
        decoding = [r for r in runs if r in self._active and r.seq.phase is Phase.DECODE]
        if decoding:
            failed = slot.batch.step([r.seq for r in decoding])
            for run in decoding:
                if run.seq in failed:
                    self._fail(run, failed[run.seq])
                elif run.seq.phase is Phase.DONE:
                    self._end(run, run.seq.result)

    # -- a request joins ----------------------------------------------------------------------

    def _admit(self, job: Job | None) -> bool:
        """Start `job`'s sequence from the KV state the pool picks; False for the stop sign."""
        if job is None:
            return False
        if job is _WAKE:
            return True
        job.started = True
        try:
            run = self._begin(job)
        except Exception as exc:  # a bug must fail one request, never the worker
            log.exception("job failed")
            job.emit(Failed(f"internal error: {type(exc).__name__}: {exc}"))
            return True
        if run is not None:
            self._active.append(run)
            self._count_memory()
            if run.seq.phase is Phase.DONE:  # a prewarm with nothing left to prefill
                self._end(run, run.seq.result)
        return True

    def _begin(self, job: Job) -> Running | None:
        lm, pool = job.slot.lm, job.slot.pool
        assert lm is not None and pool is not None
        if job.cancelled and self._lockstep is None:  # under lockstep rank 0 ended these before its tick
            self._end_unstarted(job)
            return None
        label = f"tool-output ids={len(job.conv.live_calls)}" if job.conv and job.conv.live_calls else None
        start = pool.start(job.text, job.params.prompt, limit=lm.context_length - 1, label=label, visible=job.visible,
                           owner=job.conv.owner if job.conv else LOCAL_OWNER)
        job.cached = start.cached
        with self.counters.lock:
            c = self.counters
            c.lookups[start.source] = c.lookups.get(start.source, 0) + 1
            c.live_continuations += bool(label and start.source in ("visible", "disk"))
        if label and start.source not in ("visible", "disk"):
            # Its live state was replaced while it waited: a tool result alone cannot be
            # prefilled cold (the model would never see its own call).
            pool.abandon(start)
            self._log(job, lm, "failed", Usage(len(job.params.prompt), 0), 0.0, 0.0)
            job.emit(Failed("the live state of these tool calls is gone (another request replaced it); "
                            "send the full conversation instead", code="continuation_state_unavailable"))
            return None
        params = replace(
            job.params, prompt=start.tokens, cached=start.cached,
            max_tokens=min(job.params.max_tokens, lm.context_length - len(start.tokens)),
        )
        conv = job.conv or Conversation(items=[])
        sampled: list[int] = []
        turn = TurnOutput(lm.tokenizer, conv, job.text, job.emit, sampled, one_call=params.one_call,
                          stop=params.stop, raw=params.raw)

        def emit(event: GenerationEvent) -> None:
            if isinstance(event, TextDelta):
                turn.feed(event.text, event.logprobs)
            else:
                job.emit(event)

        try:
            seq = Sequence(lm, params, start.session.cache, emit, sampled=sampled,
                           whole=lambda: params.one_call and bool(turn.calls) or turn.stopped,
                           drafting=self._drafting(params, job.slot.draft))
        except Exception:
            pool.abandon(start)
            raise
        return Running(job, start, seq, turn, time.monotonic())

    def _end_unstarted(self, job: Job) -> None:
        """A job cancelled before it started: it ends with nothing prefilled."""
        n = len(job.params.prompt)
        self._log(job, job.slot.lm, "cancelled", Usage(n, 0), 0.0, 0.0, f" prefilled=0/{n}")
        job.emit(Finished("cancelled", Usage(n, 0)))

    def _drafting(self, params: GenerationParams, draft: LoadedModel | None) -> Drafting | None:
        """The sequence's speculation: --speculate's drafter, unless the request turned it off.
        Under --speculate draft, a model served without a draft model (one not the first
        --model) does not speculate."""
        mode = self.settings.speculate
        if mode == "off" or not params.speculate or (mode == "draft" and draft is None):
            return None
        if mode == "draft":
            return Drafting(self.settings.num_draft_tokens, drafter=DraftModel(draft))
        return Drafting(self.settings.num_draft_tokens)

    # -- a request ends -----------------------------------------------------------------------

    def _end(self, run: Running, done: Finished) -> None:
        """Emit the ending, then today's bookkeeping: binding, remembered calls, the session."""
        self._active.remove(run)
        slot = run.job.slot
        slot.batch.release(run.seq)  # its cache back in its own form, for the session pool
        job, start, turn, lm = run.job, run.start, run.turn, slot.lm
        extra, binding, calls = "", None, None
        try:
            if done.reason == "cancelled":
                extra = f" prefilled={run.seq.prefilled}/{len(start.tokens)}"
            else:
                turn.finish(cut=done.reason == "length")
                done = replace(done, usage=replace(done.usage,
                                                   reasoning_tokens=turn.reasoning_tokens(done.usage.output_tokens)))
        except Exception as exc:
            return self._fail(run, exc, listed=False)
        # Counted before the client hears the end: /metrics read after a reply includes it.
        self._log(job, lm, _STATUS[done.reason], done.usage, done.prefill_tps, done.decode_tps,
                  extra + self._count_drafts(run.seq))
        job.emit(done)
        if done.reason != "cancelled" and job.conv is not None and run.seq.params.max_tokens > 0:  # a prewarm has no turn
            calls = None if turn.dropped else turn.remember(slot.calls)  # its sampled text is not the reply's
            ended = lm.tokenizer.decode(run.seq.sampled[-1:]) if done.reason == "stop" else ""
            try:
                # A reply that dropped sampled text (TurnOutput.dropped) is not what the KV
                # holds: bound to its transcript, a replay would continue hidden text.
                binding = None if turn.dropped else turn.binding(slot.calls, ended)
            except Exception:  # the reply is out; without a binding only the next lookup is slower
                log.exception("the turn's visible transcript could not be rendered")
        slot.pool.finish(start, run.seq.sampled, ok=True, binding=binding, calls=calls)
        if job.keep_history and done.reason != "cancelled":
            slot.pool.keep_history(start, job.keep_history)
        self._count_kv()
        self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.monotonic() - run.began)

    def _fail(self, run: Running, exc: Exception, listed: bool = True) -> None:
        """This sequence failed: its client hears why, its session (half-written) is dropped,
        and the batch goes on without it."""
        if listed:
            self._active.remove(run)
        slot = run.job.slot
        try:
            slot.batch.release(run.seq)
        except Exception:  # its session is dropped below anyway
            log.exception("the failed sequence's cache could not be handed back")
        log.error("generation failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        slot.pool.finish(run.start, run.seq.sampled, ok=False, binding=None)
        self._log(run.job, slot.lm, "failed", Usage(len(run.start.tokens), 0), 0.0, 0.0, self._count_drafts(run.seq))
        if out_of_memory(exc):
            run.job.emit(Failed(f"the server ran out of memory for this request ({exc}); the others go on: retry "
                                "it, or with a shorter prompt or fewer output tokens", code="insufficient_memory"))
        else:
            run.job.emit(Failed(f"generation failed: {type(exc).__name__}: {exc}"))
        self._count_kv()

    def _count_drafts(self, seq: Sequence) -> str:
        """Add an ended sequence's drafts to the counters; its request log line's part."""
        d = seq.drafting
        if d is None:
            return ""
        with self.counters.lock:
            c = self.counters
            c.drafted[self.settings.speculate] = c.drafted.get(self.settings.speculate, 0) + d.drafted
            c.accepted[self.settings.speculate] = c.accepted.get(self.settings.speculate, 0) + d.accepted
        return f" speculation={d.accepted}/{d.drafted}"

    def _count_kv(self) -> None:
        """After a sequence ended: the resident KV for /metrics."""
        try:  # bookkeeping: a failure here must not fail the step
            sessions = [s for slot in list(self.models.slots.values()) if slot.pool is not None
                        for s in list(slot.pool.sessions)]
            self.counters.kv_sessions, self.counters.kv_bytes = len(sessions), sum(s.nbytes for s in sessions)
            self._count_memory()
        except Exception:
            log.exception("the resident KV could not be counted")

    def _count_memory(self) -> None:
        """The memory budget's figures for /metrics: when a sequence joins or ends, not every step."""
        self.gate.count(sum(r.job.kv_need for r in self._active), self._pools())

    def _log(self, job: Job, lm: LoadedModel, status: str, usage: Usage, prefill: float, decode: float, extra: str = "") -> None:
        c = self.counters
        with c.lock:
            c.requests[status] = c.requests.get(status, 0) + 1
            c.prompt_tokens += usage.input_tokens
            c.output_tokens += usage.output_tokens
        if job.keep_history is not None:
            extra += " purpose=compaction"
        elif job.params.max_tokens == 0:
            extra += " purpose=prewarm"
        log.info(
            "request route=%s model=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d prefill_tps=%.1f "
            "decode_tps=%.1f status=%s%s",
            job.route, lm.id, usage.input_tokens, usage.cached_tokens, usage.output_tokens, prefill, decode, status, extra,
        )
