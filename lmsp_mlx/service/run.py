"""One response from request to result, shared by the LMSP and /v1 routes.

`ResponseRun` validates what the model can do, renders and measures the prompt, queues the
job, and folds the worker's events into the response object; the routes only choose the
framing (sync JSON, LMSP SSE, Open Responses SSE).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from ..engine.events import Failed, Finished
from ..engine.generate import GenerationParams, Penalties
from ..engine.constrain import Constraint, GrammarError
from ..engine.grammar import ReplySpec, full_grammar
from ..engine.output import OutputFormat
from ..engine.loader import LoadedModel
from ..engine.worker import Engine, Job
from ..protocol.ids import new_id
from ..protocol.problems import Problem
from ..protocol.requests import (FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, ReasoningItem,
                                 ResponsesRequest)
from ..protocol.responses import (IncompleteDetails, InputTokensDetails, OutputTokensDetails,
                                  ResponseObject, ResponseUsage, Status)
from ..protocol.auth import LOCAL_OWNER
from ..protocol.routes import Route
from . import compaction
from .conversation import open_reasoning, prepare
from ..protocol.item_events import ItemEvent
from .items import ItemFolder
from .sealing import Sealer

log = logging.getLogger("lmsp_mlx.server")


def check_model(lm: LoadedModel, model: str) -> None:
    """404 `model_not_found` for a model this server does not serve."""
    if model != lm.id:
        raise Problem("model_not_found", f"model {model!r} is not served here; try {lm.id!r}", param="model")


def check_room(prompt_tokens: int, ctx: int, param: str) -> int:
    """The output tokens the context leaves after the prompt; 400 `context_length_exceeded`
    where it leaves none."""
    if prompt_tokens >= ctx:
        raise Problem("context_length_exceeded", f"the prompt has {prompt_tokens} tokens but the model's context is "
                      f"{ctx} tokens (at least one must remain for the output)", param=param)
    return ctx - prompt_tokens


def stop_job(engine: Engine, job: Job) -> None:
    """The client left: the worker stops the job at its next prefill chunk or decode step,
    and a job still queued leaves the queue."""
    job.cancel()
    if not job.started:
        engine.withdraw(job)


def check_capabilities(req: ResponsesRequest, capabilities: tuple[str, ...]) -> None:
    """400 `unsupported_capability` for what this model/service cannot do (yet)."""
    fmt = req.response_format
    if fmt is None and req.text and isinstance(req.text.get("format"), dict):
        fmt_type, where = req.text["format"].get("type", "text"), "text.format"
    else:
        fmt_type, where = (fmt.type if fmt else "text"), "response_format"
    if fmt_type != "text" and "structured_output" not in capabilities:
        raise Problem(
            "unsupported_capability",
            f"response_format {fmt_type!r} needs the 'structured_output' capability this model lacks",
            param=where,
        )
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or []):
        raise Problem("unsupported_capability", "logprobs are not returned by this server",
                      param="top_logprobs" if req.top_logprobs else "include")
    if req.prompt is not None:
        raise Problem("unsupported_capability", "stored prompts (prompt) are not served here: send the instructions "
                      "and input themselves", param="prompt")
    if req.conversation is not None:
        raise Problem("unsupported_capability", "OpenAI's Conversations API is not served here: chain responses "
                      "with previous_response_id (store: true), or send the whole conversation", param="conversation")
    if req.previous_response_id is not None and "conversations" not in capabilities:
        raise Problem(
            "unsupported_capability",
            "previous_response_id needs the 'conversations' capability this service lacks",
            param="previous_response_id",
        )


class ResponseRun:
    """`req` is the request as sent; `history` the stored conversation its
    `previous_response_id` names, rendered before its input. `on_end`, when the response is
    to be stored, is called once it has ended. `sealer` opens sealed reasoning and compaction
    items in the input and, on /v1 with `include: ["reasoning.encrypted_content"]`, seals
    the reasoning out. `compact`: the run writes the summary of a compaction, and keeps
    the conversation's text in `compacted` (its KV is checkpointed under it)."""

    def __init__(self, engine: Engine, req: ResponsesRequest, route: Route, prefill_step: int, sealer: Sealer,
                 histories: compaction.Histories, history: list[InputItem] | None = None,
                 on_end: Callable[["ResponseRun"], None] | None = None, compact: bool = False,
                 stop: tuple[str, ...] = (), owner: str = LOCAL_OWNER) -> None:
        lm = engine.model
        assert lm is not None
        check_model(lm, req.model)
        check_capabilities(req, lm.capabilities)
        self.engine = engine
        self.req = req
        self.route = route
        self.prefill_step = prefill_step
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.status: Status = "in_progress"
        self.sealer = sealer
        sealed = route == "v1" and "reasoning.encrypted_content" in (req.include or [])
        self.folder = ItemFolder(seal=(lambda raw: sealer.seal("reasoning", {"raw": raw})) if sealed else None)
        self.usage: ResponseUsage | None = None
        self.incomplete_reason: str | None = None
        self.error: Problem | None = None  # why a failed run failed
        self.job = None
        self.limited_by_context = False
        self.history = history or []
        self.on_end = on_end
        self.histories = histories
        self.compact = compact
        self.compacted: str | None = None
        self.stop = stop  # Chat's stop sequences (http/chat.py trims the text at them: service/stops.py)
        self.owner = owner  # the token that sent it (lmsp_mlx/http/auth.py)
        self._items: asyncio.Queue[ItemEvent | None] = asyncio.Queue()  # _fold_all -> events()
        self._crash: Exception | None = None
        self._pump: asyncio.Task | None = None  # held: the loop keeps only weak references to tasks

    async def start(self) -> None:
        """Render and measure the prompt (off the event loop), then queue the job."""
        conv, spec, prompt, visible = await self.prompt()
        await self._submit(conv, spec, prompt, visible)

    async def prompt(self):
        """The conversation, its reply constraint, its prompt and visible text, after any
        compaction and truncation (what `start` queues; POST /v1/responses/input_tokens
        counts it)."""
        lm = self.engine.model
        items = self.history + self.req.items()
        open_reasoning(items, self.sealer, offset=len(self.history))  # the same item objects `prepare` sees
        if self.compact and not items:
            raise Problem("invalid_request", "there is no conversation to compact: input is empty", param="input")
        items, head = await asyncio.to_thread(compaction.expand, items, self.req, self.sealer, self.histories,
                                              self.engine.pool.disk, lm.tokenizer, len(self.history))
        ctx = lm.context_length
        conv, spec, prompt, visible = await self._render(items, head)
        # truncation "auto" (OpenAI's): the oldest items go until the prompt leaves room for
        # the output asked for; a conversation that cannot shrink enough is still a 400.
        room_asked = min(self.req.max_output_tokens or 1, ctx // 2)
        if self.req.truncation == "auto" and len(prompt.tokens) + room_asked > ctx:
            shorter = await asyncio.to_thread(successively_shorter, items)  # [k]: k drops made
            low, high = 1, len(shorter) - 1  # the fewest drops that fit: prompts shrink as k grows
            while low < high:
                mid = (low + high) // 2
                if len((await self._render(shorter[mid], head))[2].tokens) + room_asked <= ctx:
                    high = mid
                else:
                    low = mid + 1
            if high >= 1:
                log.info("truncation=auto: %d prompt tokens leave no room for %d output tokens; dropped the %d "
                         "oldest items (of %d)", len(prompt.tokens), room_asked, len(items) - len(shorter[high]),
                         len(items))
                items = shorter[high]
                conv, spec, prompt, visible = await self._render(items, head)
        return conv, spec, prompt, visible

    async def _submit(self, conv, spec, prompt, visible) -> None:
        lm = self.engine.model
        ctx = lm.context_length
        constraint = await asyncio.to_thread(self._constraint, spec, prompt.text) if spec else None
        room = check_room(len(prompt.tokens), ctx, "input")
        limit = self.req.max_output_tokens or lm.default_max_output_tokens  # --max-output-tokens, where it sets none
        self.limited_by_context = limit is None or limit > room
        params = GenerationParams(
            prompt=prompt.tokens,
            max_tokens=0 if self.req.generate is False else min(limit or room, room),
            prefill_step=self.prefill_step,
            constraint=constraint,
            one_call=self.req.parallel_tool_calls is False,
            stop=self.stop,
            **sampling(self.req, lm.vocab_size),
        )
        self.job = self.engine.submit(params, self.route, text=prompt.text, conv=conv, visible=visible,
                                      keep_history=self.compacted)
        self._pump = asyncio.get_running_loop().create_task(self._fold_all(), name=self.id)

    async def _render(self, items: list[InputItem], head: str):
        """The conversation of `items`, its reply constraint, its prompt and visible text."""
        lm = self.engine.model
        full = self.req.model_copy(update={"input": items})
        # The stored conversation's items before the request's own (negative: a compaction
        # or truncation dropped some of the request's own from the front).
        offset = len(items) - len(self.req.items())
        conv, spec = prepare(full, self.route, lm.tokenizer, self.engine.calls, "reasoning" in lm.capabilities,
                             head, offset, self.owner)
        if self.compact:
            self.compacted = await asyncio.to_thread(conv.history, lm.tokenizer, self.engine.calls)
            if not self.compacted:
                raise Problem("unsupported_capability", "this model's chat template does not render a "
                              "conversation that can be continued, so it cannot be compacted")
            conv.items = conv.items + [MessageItem(role="user", content=compaction.SUMMARY_REQUEST)]
        prompt, visible = await asyncio.to_thread(conv.prompt, lm.tokenizer, self.engine.calls)
        return conv, spec, prompt, visible

    def _constraint(self, spec: ReplySpec, prompt_text: str) -> Constraint | None:
        """The reply's grammar, compiled before any generation (a failure is a 400)."""
        tokenizer = self.engine.model.tokenizer
        fmt = OutputFormat.of(tokenizer)
        lark = full_grammar(spec, fmt, fmt.opens_in_reasoning(prompt_text), tokenizer)
        if lark is None:
            log.info("the reply constraint (%s) cannot be expressed for this model's call syntax: not enforced", spec.kind)
            return None
        try:
            return Constraint(tokenizer, lark)
        except GrammarError as exc:
            where = "tools" if spec.kind in ("call", "calls") else "tool_choice" if spec.kind == "text" else "response_format"
            raise Problem("invalid_request", f"the reply's constraint cannot be compiled: {exc}", param=where) from None

    async def events(self) -> AsyncIterator[ItemEvent]:
        """Item-level events as the worker produces them; the final state is set at the end.
        A reader may leave early (a client that disconnected): the run still ends, and is
        kept, on its own (`_fold_all`)."""
        while (e := await self._items.get()) is not None:
            yield e
        if self._crash is not None:
            raise self._crash

    async def _fold_all(self) -> None:
        """Fold every worker event into the response, whether or not anyone reads them."""
        try:
            async for event in self.job.stream():
                for e in self._fold(event):
                    self._items.put_nowait(e)
            self.completed_at = int(time.time())
            if self.on_end is not None:
                await asyncio.to_thread(self.on_end, self)
        except Exception as exc:  # a bug: the reader's to report (a task fails, a request 500s)
            self._crash = exc
        finally:
            self._items.put_nowait(None)

    def _fold(self, event) -> list[ItemEvent]:
        if isinstance(event, Finished):
            cut = "incomplete" if event.reason in ("length", "cancelled") else "completed"  # the item it cut
            out = self.folder.close(ensure_message=event.reason != "cancelled" and self.req.generate is not False,
                                    status=cut)
            u = event.usage
            self.usage = ResponseUsage(
                input_tokens=u.input_tokens, output_tokens=u.output_tokens, total_tokens=u.total_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=u.cached_tokens),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=u.reasoning_tokens),
            )
            if event.reason == "length":
                self.status = "incomplete"
                self.incomplete_reason = "context_length" if self.limited_by_context else "max_output_tokens"
            else:
                self.status = "cancelled" if event.reason == "cancelled" else "completed"
            return out
        if isinstance(event, Failed):
            self.status = "failed"
            self.error = Problem(event.code, event.message)
            return []
        return self.folder.feed(event)

    async def ended(self) -> None:
        """Wait until the run has ended and is stored (when it is to be)."""
        if self._pump is not None:
            await asyncio.shield(self._pump)

    @property
    def waiting(self) -> bool:
        """Queued behind other requests: the worker runs another one while this waits."""
        return self.job is not None and self.status == "in_progress" and self.engine.behind_another(self.job)

    def stored_request(self) -> dict[str, Any]:
        """The request as the store keeps it: its own input items, not the history before them."""
        return {**self.req.model_dump(mode="json", exclude_none=True),
                "input": [item.model_dump(mode="json", exclude_none=True) for item in self.req.items()]}

    def cancel(self) -> None:
        """The client left: stop the worker at its next prefill chunk or decode step."""
        if self.job is not None and self.status == "in_progress":
            stop_job(self.engine, self.job)

    def response(self) -> ResponseObject:
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=self.status,
            model=self.req.model,
            output=self.folder.snapshot() if self.status != "in_progress" else [],
            usage=self.usage,
            error=self.error.document() if self.error is not None else None,
            incomplete_details=IncompleteDetails(reason=self.incomplete_reason) if self.incomplete_reason else None,
        )

    async def run_to_end(self) -> ResponseObject:
        """Synchronous mode; a failed generation is a problem document, not a response object."""
        try:
            async for _ in self.events():
                pass
        finally:
            self.cancel()
        if self.status == "failed":
            raise self.error
        return self.response()


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
        "penalties": penalties,
        "seed": req.seed,
    }


def successively_shorter(items: list[InputItem]) -> list[list[InputItem]]:
    """The conversation, then without its oldest item, and so on (drop_oldest) while items
    can go. Quadratic in the items (each a list), so off the event loop: 3,000 items take
    under a second."""
    out = [items]
    while (fewer := drop_oldest(out[-1])) is not None:
        out.append(fewer)
    return out


def drop_oldest(items: list[InputItem]) -> list[InputItem] | None:
    """The conversation without its oldest item that is not a system or developer message,
    or None when only those and the last item are left. A reasoning item goes with the calls
    right after it (a replayed call of a reasoning model needs its reasoning), and a call
    with its outputs."""
    pinned = lambda i: isinstance(i, MessageItem) and i.role in ("system", "developer")  # noqa: E731
    first = next((k for k, item in enumerate(items[:-1]) if not pinned(item)), None)
    if first is None:
        return None
    last = first
    if isinstance(items[first], ReasoningItem):
        while last + 1 < len(items) - 1 and isinstance(items[last + 1], FunctionCallItem):
            last += 1
    calls = {i.call_id for i in items[first:last + 1] if isinstance(i, FunctionCallItem)}
    return [item for k, item in enumerate(items) if not first <= k <= last
            and not (isinstance(item, FunctionCallOutputItem) and item.call_id in calls)]
