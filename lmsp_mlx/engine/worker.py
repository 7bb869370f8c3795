"""The one worker thread that owns the model.

MLX arrays, the model and the KV sessions live on this thread only: it loads the model,
then runs queued jobs one at a time, each starting from the KV state the session pool picks
(lmsp_mlx/cache). Requests talk to it through `Job`s: a bounded queue in, an asyncio queue
of `GenerationEvent`s out (handed over with `call_soon_threadsafe`). On stop it checkpoints
the resident sessions.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from ..cache.calls import LOCAL_OWNER, CallMemory
from ..cache.disk import CheckpointStore
from ..cache.pool import Policy, SessionPool
from ..protocol.problems import Problem
from .events import Failed, Finished, GenerationEvent, TextDelta, Usage
from .generate import Cancelled, GenerationParams, generate
from .loader import LoadedModel, ModelLoadError, load_model
from .turn import Conversation, TurnOutput

log = logging.getLogger("lmsp_mlx.engine")


@dataclass(eq=False)  # compared by identity (Engine.withdraw finds it in the queue)
class Job:
    params: GenerationParams
    route: str
    loop: asyncio.AbstractEventLoop
    text: str = ""  # the rendered prompt: what text-prefix lookups compare
    visible: str | None = None  # the prompt as a visible-only replay renders, where `text` reveals hidden reasoning
    keep_history: str | None = None  # a compaction: checkpoint the KV of this leading part of `text`
    conv: Conversation | None = None  # the items behind the prompt: for the turn's visible transcript
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: bool = False  # the worker took it from the queue (a task is then `in_progress`)
    ended: bool = False  # its ending event is out (from the worker, or abandon())
    _cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: GenerationEvent) -> None:
        if isinstance(event, (Finished, Failed)):
            self.ended = True
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


# Finished.reason -> the response status clients see, used in logs and metrics.
_STATUS = {"stop": "completed", "complete": "completed", "length": "incomplete", "cancelled": "cancelled"}


@dataclass
class Counters:
    """What /metrics reports; written by the worker thread, and by the event loop for a
    job withdrawn from the queue (hence the lock)."""

    requests: dict[str, int] = field(default_factory=dict)  # by final status
    prompt_tokens: int = 0
    output_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class CacheSettings:
    policy: Policy = Policy()
    disk_dir: Path | None = None  # None: no checkpoints on disk
    disk_bytes: int = 4096 * 2**20


class Engine:
    def __init__(self, model_path: Path, *, ctx: int | None, max_queue: int, model_id: str | None = None,
                 cache: CacheSettings = CacheSettings()):
        self._path = model_path
        self._ctx = ctx
        self._model_id = model_id
        self._cache_settings = cache
        self.pool: SessionPool | None = None
        self.calls = CallMemory()  # read by request handlers while they render (it has a lock)
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._ready = threading.Event()
        self._error: Exception | None = None
        self.model: LoadedModel | None = None
        self.counters = Counters()
        self._current: Job | None = None
        self._job_seconds = 1.0  # a moving average of the time a job holds the worker (for Retry-After)
        self._thread = threading.Thread(target=self._run, name="lmsp-worker", daemon=True)

    def start(self) -> LoadedModel:
        """Start the worker and wait until the model is loaded (or raise why not)."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self.model is not None
        return self.model

    def cancel_all(self) -> None:
        """Shutdown: the running job stops at its next step, waiting ones end as they are taken."""
        if self._current is not None:
            self._current.cancel()
        with self._jobs.mutex:
            waiting = list(self._jobs.queue)
        for job in waiting:
            if job is not None:
                job.cancel()

    def abandon_all(self) -> None:
        """Shutdown: end every job's stream now (Job.abandon), the worker's included."""
        with self._jobs.mutex:
            jobs = [self._current, *self._jobs.queue]
        for job in jobs:
            if job is not None:
                job.abandon()

    def stop(self) -> None:
        """Cancel everything and end the worker thread."""
        if not self._thread.is_alive():
            return
        self.cancel_all()
        self._jobs.put(None)
        self._thread.join(timeout=300)  # it checkpoints the resident sessions before ending

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
        job.emit(Finished("cancelled", Usage(n, 0)))
        self._log(job, self.model, "cancelled", Usage(n, 0), 0.0, 0.0, f" prefilled=0/{n} withdrawn from the queue")
        return True

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def behind_another(self, job: Job) -> bool:
        """`job` waits for another one, running or ahead of it in the queue: queued, as
        clients see it (not the instant between its submission and an idle worker taking it)."""
        if job.started:
            return False
        current = self._current
        if current is not None and current is not job:
            return True
        with self._jobs.mutex:
            return bool(self._jobs.queue) and self._jobs.queue[0] is not job

    def submit(self, params: GenerationParams, route: str, text: str = "", conv: Conversation | None = None,
               visible: str | None = None, keep_history: str | None = None) -> Job:
        job = Job(params=params, route=route, loop=asyncio.get_running_loop(), text=text, conv=conv, visible=visible,
                  keep_history=keep_history)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            # A slot frees when the running job ends: about the recent time per job.
            wait = max(1, math.ceil(self._job_seconds))
            raise Problem(
                "queue_full",
                f"{self._jobs.maxsize} request{' is' if self._jobs.maxsize == 1 else 's are'} already waiting for "
                f"the model; retry in about {wait} s",
                headers={"Retry-After": str(wait)},
            ) from None
        return job

    def _run(self) -> None:
        try:
            self.model = load_model(self._path, model_id=self._model_id, ctx=self._ctx)
            self.pool = self._make_pool(self.model)
        except Exception as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        while (job := self._jobs.get()) is not None:
            self._current = job
            job.started = True
            began = time.monotonic()
            try:
                self._run_job(job)
            except Exception as exc:  # a bug must fail one request, never the worker
                log.exception("job failed")
                job.emit(Failed(f"internal error: {type(exc).__name__}: {exc}"))
            self._current = None
            self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.monotonic() - began)
        self.pool.close()

    def _make_pool(self, lm: LoadedModel) -> SessionPool:
        cs = self._cache_settings
        fingerprint = lm.fingerprint
        if cs.policy.kv_bits:  # checkpoints of quantized KV belong to their own folder
            lm.kv_cache = f"{cs.policy.kv_bits}-bit, group {cs.policy.kv_group_size}"
            fingerprint = hashlib.sha256(f"{fingerprint}:kv:{lm.kv_cache}".encode()).hexdigest()
        disk = None
        if cs.disk_dir is not None:
            try:
                vocab = lm.vocab_size or 2**31
                disk = CheckpointStore(cs.disk_dir, fingerprint, cs.disk_bytes, calls=self.calls, vocab_size=vocab)
            except OSError as exc:
                log.warning("kv disk %s unusable (%s): checkpoints are off", cs.disk_dir, exc)
        pool = SessionPool(lm.model, lm.tokenizer, cs.policy, disk)
        if cs.policy.kv_bits:  # a quantized cache the model cannot use is a start-up error, not a 500 later
            try:
                mx.eval(lm.model(mx.array([[0]]), cache=pool.new_cache()))
            except ValueError as exc:
                raise ModelLoadError(f"--kv-bits {cs.policy.kv_bits} with --kv-group-size {cs.policy.kv_group_size} "
                                     f"does not fit {lm.id}: {exc}") from None
        return pool

    def _run_job(self, job: Job) -> None:
        lm, pool = self.model, self.pool
        assert lm is not None and pool is not None
        if job.cancelled:
            n = len(job.params.prompt)
            job.emit(Finished("cancelled", Usage(n, 0)))
            self._log(job, lm, "cancelled", Usage(n, 0), 0.0, 0.0, f" prefilled=0/{n}")
            return
        label = f"tool-output ids={len(job.conv.live_calls)}" if job.conv and job.conv.live_calls else None
        start = pool.start(job.text, job.params.prompt, limit=lm.context_length - 1, label=label, visible=job.visible,
                           owner=job.conv.owner if job.conv else LOCAL_OWNER)
        if label and start.source not in ("visible", "disk"):
            # Its live state was replaced while it waited: a tool result alone cannot be
            # prefilled cold (the model would never see its own call).
            pool.abandon(start)
            job.emit(Failed("the live state of these tool calls is gone (another request replaced it); "
                            "send the full conversation instead", code="continuation_state_unavailable"))
            self._log(job, lm, "failed", Usage(len(job.params.prompt), 0), 0.0, 0.0)
            return
        params = replace(
            job.params, prompt=start.tokens, cached=start.cached,
            max_tokens=min(job.params.max_tokens, lm.context_length - len(start.tokens)),
        )
        conv = job.conv or Conversation(items=[])
        sampled: list[int] = []
        turn = TurnOutput(lm.tokenizer, conv, job.text, job.emit, sampled, one_call=job.params.one_call,
                          stop=job.params.stop, raw=job.params.raw)

        def emit(event: GenerationEvent) -> None:
            if isinstance(event, TextDelta):
                turn.feed(event.text)
            else:
                job.emit(event)

        prompt_len, extra, binding, calls = len(start.tokens), "", None, None
        try:
            done = generate(lm, params, emit, lambda: job.cancelled, cache=start.session.cache, sampled=sampled,
                            whole=lambda: params.one_call and bool(turn.calls) or turn.stopped)
        except Cancelled as stop:
            done = Finished("cancelled", Usage(prompt_len, stop.produced, start.cached), stop.prefill_tps, stop.decode_tps)
            extra = f" prefilled={stop.prefilled}/{prompt_len}"
        except Exception as exc:  # the request fails, the worker keeps serving
            log.exception("generation failed")
            pool.finish(start, sampled, ok=False, binding=None)
            job.emit(Failed(f"generation failed: {type(exc).__name__}: {exc}"))
            self._log(job, lm, "failed", Usage(prompt_len, 0), 0.0, 0.0)
            return
        if done.reason != "cancelled":
            turn.finish(cut=done.reason == "length")
            done = replace(done, usage=replace(done.usage, reasoning_tokens=turn.reasoning_tokens(done.usage.output_tokens)))
        job.emit(done)
        if done.reason != "cancelled" and job.conv is not None and params.max_tokens > 0:  # a prewarm has no turn
            calls = None if turn.dropped else turn.remember(self.calls)  # its sampled text is not the reply's
            ended = lm.tokenizer.decode(sampled[-1:]) if done.reason == "stop" else ""
            try:
                # A reply that dropped sampled text (TurnOutput.dropped) is not what the KV
                # holds: bound to its transcript, a replay would continue hidden text.
                binding = None if turn.dropped else turn.binding(self.calls, ended)
            except Exception:  # the reply is out; without a binding only the next lookup is slower
                log.exception("the turn's visible transcript could not be rendered")
        self._log(job, lm, _STATUS[done.reason], done.usage, done.prefill_tps, done.decode_tps, extra)
        pool.finish(start, sampled, ok=True, binding=binding, calls=calls)
        if job.keep_history and done.reason != "cancelled":
            pool.keep_history(start, job.keep_history)

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
