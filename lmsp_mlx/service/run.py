"""One response from request to result, shared by the LMSP and /v1 routes.

`ResponseRun` validates what the model can do, renders and measures the prompt, queues the
job, and folds the worker's events into the response object (the job and its pump are
service/worker_run.py's, as for text completions); the routes only choose the framing (sync
JSON, LMSP SSE, Open Responses SSE, Chat chunks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ..engine.events import Failed, Finished, GenerationEvent
from ..engine.generate import GenerationParams
from ..engine.constrain import Constraint, GrammarError
from ..engine.grammar import ReplySpec, full_grammar
from ..engine.output import OutputFormat
from ..engine.worker import Engine
from ..protocol.ids import new_id
from ..protocol.problems import Problem
from ..protocol.requests import (FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, ReasoningItem,
                                 ResponsesRequest)
from ..protocol.responses import (IncompleteDetails, InputTokensDetails, OutputTokensDetails,
                                  ResponseObject, ResponseUsage)
from ..protocol.auth import LOCAL_OWNER
from ..protocol.routes import Route
from . import compaction
from .conversation import open_reasoning, prepare
from ..protocol.item_events import ItemEvent
from .items import ItemFolder
from .sealing import Sealer
from .worker_run import WorkerRun, check_room, sampling

log = logging.getLogger("lmsp_mlx.server")


def check_capabilities(req: ResponsesRequest, capabilities: tuple[str, ...]) -> None:
    """400 `unsupported_capability` for what this model/service cannot do (yet)."""
    if "text" not in capabilities:
        raise Problem("unsupported_capability", f"{req.model!r} is an embedding model: it serves /v1/embeddings "
                      "only", param="model")
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


def seal_purpose(route: Route) -> str:
    """What a route's sealed reasoning is sealed for: a thinking block's `signature` is its
    own purpose, so it cannot be replayed as an `encrypted_content`, nor the other way."""
    return "thinking" if route == "messages" else "reasoning"


class ResponseRun(WorkerRun[ItemEvent]):
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
        super().__init__(engine, new_id("resp"), req.model)
        self.req = req
        self.route = route
        self.prefill_step = prefill_step
        self.id = self.name
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.sealer = sealer
        # Anthropic's thinking blocks always carry their signature; /v1 seals on request.
        sealed = route == "messages" or route == "v1" and "reasoning.encrypted_content" in (req.include or [])
        self.purpose = seal_purpose(route)
        self.folder = ItemFolder(seal=(lambda raw: self.sealer.seal(self.purpose, {"raw": raw})) if sealed else None,
                                 logprobs=req.logprobs() is not None)
        self.usage: ResponseUsage | None = None
        self.incomplete_reason: str | None = None
        self.limited_by_context = False
        self.history = history or []
        self.on_end = on_end
        self.histories = histories
        self.compact = compact
        self.compacted: str | None = None
        self.stop = stop  # Chat's stop sequences (http/chat.py trims the text at them: service/stops.py)
        self.owner = owner  # the token that sent it (lmsp_mlx/http/auth.py)

    async def start(self) -> None:
        """Render and measure the prompt (off the event loop), then queue the job; a run
        refused before its job lets its model go."""
        try:
            conv, spec, prompt, visible = await self.prompt()
            await self._queue(conv, spec, prompt, visible)
        except BaseException:
            self.close()
            raise

    async def prompt(self):
        """The conversation, its reply constraint, its prompt and visible text, after any
        compaction and truncation (what `start` queues; POST /v1/responses/input_tokens
        counts it, then `close`s the run). The model is leased (and loaded) first."""
        lm = await self.lease()
        check_capabilities(self.req, lm.capabilities)
        self.sealer = self.sealer.for_model(lm.fingerprint)
        items = self.history + self.req.items()
        open_reasoning(items, self.sealer, self.purpose, offset=len(self.history))  # the item objects `prepare` sees
        if self.compact and not items:
            raise Problem("invalid_request", "there is no conversation to compact: input is empty", param="input")
        items, head = await asyncio.to_thread(compaction.expand, items, self.req, self.sealer, self.histories,
                                              self.slot.pool.disk, lm.tokenizer, len(self.history))
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

    async def _queue(self, conv, spec, prompt, visible) -> None:
        lm = self.lm
        ctx = lm.context_length
        constraint = await asyncio.to_thread(self._constraint, spec, prompt.text) if spec else None
        room = check_room(len(prompt.tokens), ctx, "input")
        limit = self.req.max_output_tokens or lm.default_max_output_tokens  # --max-output-tokens, where it sets none
        self.limited_by_context = limit is None or limit > room
        if limit is None:  # nor may it grow past what the memory budget holds beside the weights
            room = self.engine.memory_room(self.slot, len(prompt.tokens), room)
        params = GenerationParams(
            prompt=prompt.tokens,
            max_tokens=0 if self.req.generate is False else min(limit or room, room),
            prefill_step=self.prefill_step,
            constraint=constraint,
            one_call=self.req.parallel_tool_calls is False,
            stop=self.stop,
            reasoning_budget=self.req.reasoning.budget_tokens if self.req.reasoning else None,
            speculate=not (self.req.extensions and self.req.extensions.speculate is False),
            logprobs=self.req.logprobs(),
            **sampling(self.req, lm.vocab_size),
        )
        self._submit(params, self.route, text=prompt.text, conv=conv, visible=visible, keep_history=self.compacted)

    async def _render(self, items: list[InputItem], head: str):
        """The conversation of `items`, its reply constraint, its prompt and visible text."""
        lm, calls = self.lm, self.slot.calls
        full = self.req.model_copy(update={"input": items})
        # The stored conversation's items before the request's own (negative: a compaction
        # or truncation dropped some of the request's own from the front).
        offset = len(items) - len(self.req.items())
        conv, spec = prepare(full, self.route, lm.tokenizer, calls, "reasoning" in lm.capabilities,
                             head, offset, self.owner)
        if self.compact:
            self.compacted = await asyncio.to_thread(conv.history, lm.tokenizer, calls)
            if not self.compacted:
                raise Problem("unsupported_capability", "this model's chat template does not render a "
                              "conversation that can be continued, so it cannot be compacted")
            conv.items = conv.items + [MessageItem(role="user", content=compaction.SUMMARY_REQUEST)]
        prompt, visible = await asyncio.to_thread(conv.prompt, lm.tokenizer, calls)
        return conv, spec, prompt, visible

    def _constraint(self, spec: ReplySpec, prompt_text: str) -> Constraint | None:
        """The reply's grammar, compiled before any generation (a failure is a 400)."""
        tokenizer = self.lm.tokenizer
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

    async def _after(self) -> None:
        self.completed_at = int(time.time())
        if self.on_end is not None:
            await asyncio.to_thread(self.on_end, self)

    def _finished(self, event: Finished) -> None:
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
            super()._finished(event)

    def _fold(self, event: GenerationEvent) -> list[ItemEvent]:
        if isinstance(event, Finished):
            cut = "incomplete" if event.reason in ("length", "cancelled") else "completed"  # the item it cut
            return self.folder.close(ensure_message=event.reason != "cancelled" and self.req.generate is not False,
                                     status=cut)
        if isinstance(event, Failed):
            return []
        return self.folder.feed(event)

    def stored_request(self) -> dict[str, Any]:
        """The request as the store keeps it: its own input items, not the history before them."""
        return {**self.req.model_dump(mode="json", exclude_none=True),
                "input": [item.model_dump(mode="json", exclude_none=True) for item in self.req.items()]}

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
