"""The one path from a run to the worker: the checks every run makes, the job, and the pump.

`WorkerRun` queues one job and folds its events in a task of its own (`_fold_all`) whether
or not anyone reads them, so a run a client left still ends, and is kept, on its own. Its
subclasses differ only in their fold: `ResponseRun` (service/run.py) folds into output
items, `TextRun` (service/text_run.py) into text cut at stop sequences.

Invariants: `events()` ends after the worker's last event; a failed job leaves `status`
"failed" and `error` set; `cancel()` stops the worker at its next prefill chunk or decode
step, and takes a job still queued out of the queue.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Generic, TypeVar

from ..engine.events import Failed, Finished, GenerationEvent
from ..engine.generate import GenerationParams, Penalties
from ..engine.loader import LoadedModel, ModelLoadError
from ..engine.models import ModelNotFound, NoModelRoom, NotEnoughMemory
from ..engine.slot import ModelSlot
from ..engine.worker import Engine, Job, KVTooBig
from ..protocol.problems import Problem
from ..protocol.responses import Status
from ..protocol.routes import Route

Out = TypeVar("Out")


def check_room(prompt_tokens: int, ctx: int, param: str) -> int:
    """The output tokens the context leaves after the prompt; 400 `context_length_exceeded`
    where it leaves none."""
    if prompt_tokens >= ctx:
        raise Problem("context_length_exceeded", f"the prompt has {prompt_tokens} tokens but the model's context is "
                      f"{ctx} tokens (at least one must remain for the output)", param=param)
    return ctx - prompt_tokens


def sampling(req: Any, vocab: int | None) -> dict[str, Any]:
    """GenerationParams' sampling fields from a request's OpenAI-style settings, which
    Responses, Chat and text completions name alike."""
    bias = tuple((int(k), v) for k, v in (req.logit_bias or {}).items() if v)
    if bias and (vocab is None or any(t >= vocab for t, _ in bias)):
        raise Problem("invalid_request", "logit_bias names a token id outside the vocabulary"
                      + (f" (0..{vocab - 1})" if vocab else " (this model does not state its size)"),
                      param="logit_bias")
    penalties = None
    if bias or req.presence_penalty or req.frequency_penalty:
        penalties = Penalties(req.presence_penalty or 0.0, req.frequency_penalty or 0.0, bias)
    return {
        # top_p 0 keeps only the likeliest token: greedy, whatever the temperature.
        "temperature": 0.0 if req.top_p == 0 else 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": getattr(req, "top_k", None) or 0,  # Responses' (Anthropic's top_k maps onto it)
        "penalties": penalties,
        "seed": req.seed,
    }


async def acquire(engine: Engine, model: str) -> ModelSlot:
    """`model`'s slot, loaded (on demand: engine/models.py), to give back with
    `engine.release`; 404 for a model not served here, 507 where it cannot fit, 503 where
    its load failed."""
    try:
        return await engine.acquire(model)
    except ModelNotFound:
        catalog = engine.catalog
        ids = [s.id for s in catalog.named] + [m.id for m in await asyncio.to_thread(catalog.listed)]
        served = ", ".join(repr(i) for i in ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")
        raise Problem("model_not_found", f"model {model!r} is not served here; served: {served} "
                      "(GET /v1/models lists them; --model-alias maps other names onto them)",
                      param="model") from None
    except NotEnoughMemory as exc:
        raise Problem("insufficient_memory", str(exc), param="model") from None
    except NoModelRoom as exc:
        raise Problem("model_limit_reached", str(exc), param="model") from None
    except ModelLoadError as exc:
        raise Problem("model_load_failed", str(exc), param="model") from None


class WorkerRun(Generic[Out]):
    """A job on the worker and the task that folds its events into `Out`s (`_fold`)."""

    def __init__(self, engine: Engine, name: str, model: str) -> None:
        self.engine = engine
        self.name = name  # the pump task's
        self.model = model  # the id the request names
        self.slot: ModelSlot | None = None  # its model, leased from `lease` until `close`
        self._lm: LoadedModel | None = None
        self.job: Job | None = None
        self.status: Status = "in_progress"
        self.error: Problem | None = None  # why a failed run failed
        self._out: asyncio.Queue[Out | None] = asyncio.Queue()  # _fold_all -> events()
        self._crash: Exception | None = None
        self._pump: asyncio.Task | None = None  # held: the loop keeps only weak references to tasks

    async def lease(self) -> LoadedModel:
        """The request's model, loaded (on demand: engine/models.py) and held until `close`."""
        if self.slot is None:
            self.slot = await acquire(self.engine, self.model)
            self._lm = self.slot.lm
        return self.slot.lm

    @property
    def lm(self) -> LoadedModel:
        """The leased model (still readable after `close`: the run's own reference)."""
        return self._lm

    def close(self) -> None:
        """Let the model go (once: after the job ended, or when the run never queued one)."""
        if self.slot is not None:
            slot, self.slot = self.slot, None
            self.engine.release(slot)

    def _submit(self, params: GenerationParams, route: Route, **lookup) -> None:
        """Queue the job (`lookup`: what the KV lookup matches by, engine.submit) and start the pump."""
        try:
            self.job = self.engine.submit(self.slot, params, route, **lookup)
        except KVTooBig as exc:
            self.close()
            raise Problem("insufficient_memory", str(exc)) from None
        except BaseException:
            self.close()
            raise
        self._pump = asyncio.get_running_loop().create_task(self._fold_all(), name=self.name)

    def _fold(self, event: GenerationEvent) -> list[Out]:
        raise NotImplementedError

    def _failed(self, event: Failed) -> None:
        self.status = "failed"
        self.error = Problem(event.code, event.message)

    def _finished(self, event: Finished) -> None:
        self.status = "cancelled" if event.reason == "cancelled" else "completed"

    async def _after(self) -> None:
        """What a run does once its job ended, before `ended()` returns (storing it)."""

    async def _fold_all(self) -> None:
        """Fold every worker event, whether or not anyone reads them."""
        try:
            async for event in self.job.stream():
                if isinstance(event, Failed):
                    self._failed(event)
                elif isinstance(event, Finished):
                    self._finished(event)
                for out in self._fold(event):
                    self._out.put_nowait(out)
            await self._after()
        except Exception as exc:  # a bug: the reader's to report (a task fails, a request 500s)
            self._crash = exc
        finally:
            self.close()
            self._out.put_nowait(None)

    async def events(self) -> AsyncIterator[Out]:
        """What the fold makes, as the worker produces it; the final state is set at the end.
        A reader may leave early (a client that disconnected): the run still ends on its own."""
        while (out := await self._out.get()) is not None:
            yield out
        if self._crash is not None:
            raise self._crash

    async def ended(self) -> None:
        """Wait until the run has ended (and is stored, where it is to be)."""
        if self._pump is not None:
            await asyncio.shield(self._pump)

    @property
    def waiting(self) -> bool:
        """Queued behind other requests: the worker runs another one while this waits."""
        return self.job is not None and self.status == "in_progress" and self.engine.behind_another(self.job)

    def cancel(self) -> None:
        """The client left: stop the worker at its next prefill chunk or decode step, and take
        a job still queued out of the queue."""
        if self.job is not None and not self.job.ended:
            self.job.cancel()
            if not self.job.started:
                self.engine.withdraw(self.job)
