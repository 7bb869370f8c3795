"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (Claude Code,
the Anthropic SDK) over the same engine, KV sessions and tool-call continuation as
/v1/responses (protocol/messages.py maps the body).

A reply's content blocks follow the run's items (protocol/item_events.py's table): a
reasoning item is a `thinking` block whose `signature` (sent last, as Anthropic's
signature_delta) seals the raw reasoning the KV holds, a message a `text` block cut at the
first stop sequence, a call a `tool_use` block. Errors have Anthropic's shape (problems.py).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from quart import Blueprint

from ..protocol.item_events import MessagesBlock, messages_block
from ..protocol.messages import (Mapped, MessagesRequest, StopReason, message, message_id, message_usage,
                                 messages_param, parse_messages, to_responses, tool_input)
from ..protocol.problems import Problem
from ..protocol.sse import V1Event, json_text
from ..service.responses import new_run
from ..service.run import ResponseRun
from ..service.stops import StopScanner
from .auth import requires
from .body import read_json
from .context import owner, start_run, state
from .sse import loading_stream, needs_load, response_start, sse_response

log = logging.getLogger("lmsp_mlx.server")

bp = Blueprint("messages", __name__, url_prefix="/v1")


@bp.post("/messages")
@requires("responses:write")
async def create_message():
    """Anthropic's Messages: one reply, sync or streamed as message_start ... message_stop."""
    req = parse_messages(await read_json())
    mapped: Mapped | None = None
    stop = tuple(req.stop_sequences or ())
    try:
        mapped = _mapped(req)
        if await needs_load(mapped.request.model, req.stream):  # the stream starts while the model loads
            failed = lambda problem: [V1Event(messages_param(problem, mapped).anthropic_error())]  # noqa: E731
            return loading_stream(response_start("messages", mapped.request, stop=stop),
                                  lambda run: MessageReply(run, req, mapped).events(), failed)
        run = await start_run("messages", mapped.request, stop=stop)
    except Problem as problem:
        raise messages_param(problem, mapped) from None
    reply = MessageReply(run, req, mapped)
    if not req.stream:
        return await reply.complete()
    return sse_response(reply.events())


@bp.post("/messages/count_tokens")
@requires("responses:write")
async def count_tokens():
    """The prompt tokens a Messages request would prefill (system, tools and history included)."""
    req = parse_messages(await read_json(), count=True)
    mapped: Mapped | None = None
    try:
        mapped = _mapped(req)
        run = await new_run(state(), owner(), "messages", mapped.request)
        try:
            prompt = (await run.prompt())[2]
        finally:
            run.close()
    except Problem as problem:
        raise messages_param(problem, mapped) from None
    return {"input_tokens": len(prompt.tokens)}


def _mapped(req: MessagesRequest) -> Mapped:
    s = state()
    mapped = to_responses(req, keep_billing=s.settings.server.keep_billing_header)
    if mapped.billing and s.notice_once("billing-header"):
        log.info("Claude Code's x-anthropic-billing-header line is left out of system prompts: it changes every "
                 "request and would defeat KV reuse (--keep-billing-header renders it); said once")
    return mapped


class MessageReply:
    def __init__(self, run: ResponseRun, req: MessagesRequest, mapped: Mapped) -> None:
        self.run = run
        self.req = req
        self.mapped = mapped
        self.id = message_id()
        self.scanner = StopScanner(list(req.stop_sequences or ()))
        self.stopped: str | None = None  # the stop sequence that ended the text
        self.content: list[dict[str, Any]] = []  # the blocks, as sent
        self.open: dict[str, Any] | None = None  # the block open now (the last of content)

    # -- content blocks ---------------------------------------------------------------------

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.content.append(block)
        self.open = block
        return {"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _stop(self) -> dict[str, Any]:
        self.open = None
        return {"type": "content_block_stop", "index": len(self.content) - 1}

    def _open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    async def blocks(self) -> AsyncIterator[dict[str, Any]]:
        """The content blocks' events as the run produces them; after a stop sequence the
        run's events left are drained unseen."""
        async for e in self.run.events():
            kind = messages_block(e)
            if self.stopped is not None or kind is None:
                continue
            if kind is MessagesBlock.THINKING_START:
                if self.mapped.thinking_shown:
                    yield self._start({"type": "thinking", "thinking": "", "signature": ""})
            elif kind is MessagesBlock.THINKING:
                if self._open("thinking") and self.mapped.thinking_text:
                    self.open["thinking"] += e.delta
                    yield self._delta({"type": "thinking_delta", "thinking": e.delta})
            elif kind is MessagesBlock.TEXT_START:
                yield self._start({"type": "text", "text": ""})
            elif kind is MessagesBlock.TEXT:
                text, stopped = self.scanner.feed(e.delta)
                if text:
                    self.open["text"] += text
                    yield self._delta({"type": "text_delta", "text": text})
                if stopped:
                    self.stopped = self.scanner.matched
                    yield self._stop()
            elif kind is MessagesBlock.STOP:
                if self._open("text"):
                    if held := self.scanner.flush():
                        self.open["text"] += held
                        yield self._delta({"type": "text_delta", "text": held})
                    yield self._stop()
                elif self._open("thinking"):
                    self.open["signature"] = e.item.encrypted_content or ""
                    yield self._delta({"type": "signature_delta", "signature": self.open["signature"]})
                    yield self._stop()
            elif kind is MessagesBlock.TOOL_USE:
                block = {"type": "tool_use", "id": e.item.call_id, "name": e.item.name, "input": {}}
                yield self._start(block)
                block["input"] = tool_input(e.item.arguments)
                yield self._delta({"type": "input_json_delta", "partial_json": json_text(block["input"])})
                yield self._stop()

    def stop_reason(self) -> StopReason:
        if self.stopped is not None:
            return "stop_sequence"
        if self.run.status == "incomplete":
            return "model_context_window_exceeded" if self.run.incomplete_reason == "context_length" else "max_tokens"
        return "tool_use" if any(b["type"] == "tool_use" for b in self.content) else "end_turn"

    def failure(self) -> Problem | None:
        """Why the run ended without a reply: the generation failed, or the server is
        shutting down (Anthropic's overloaded: a client retries)."""
        if self.run.status == "failed":
            return self.run.error
        if self.run.status == "cancelled":
            return Problem("overloaded", "the server is shutting down")
        return None

    # -- the two framings -------------------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        try:
            async for _ in self.blocks():
                pass
        finally:
            self.run.cancel()
        if problem := self.failure():
            raise problem
        return message(self.id, self.req.model, self.content, self.stop_reason(), self.stopped,
                       message_usage(self.run.response()))

    def _started(self) -> list[V1Event]:
        """message_start (its usage as the KV lookup found it), then a ping, as Anthropic sends them."""
        job = self.run.job
        prompt, cached = (len(job.params.prompt), job.cached or 0) if job is not None else (0, 0)
        usage = {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached, "output_tokens": 0}
        start = message(self.id, self.req.model, [], None, None, usage)
        return [V1Event({"type": "message_start", "message": start}), V1Event({"type": "ping"})]

    async def events(self) -> AsyncIterator[V1Event]:
        """The stream: message_start once the prompt is in the KV (its first block follows),
        the blocks' events, message_delta with the stop reason and the whole usage, and
        message_stop; a failure is Anthropic's `error` event."""
        started = False
        try:
            async for e in self.blocks():
                if not started:
                    started = True
                    for s in self._started():
                        yield s
                yield V1Event(e)
            if problem := self.failure():
                yield V1Event(problem.anthropic_error())
                return
            if not started:
                for s in self._started():
                    yield s
            yield V1Event({"type": "message_delta",
                           "delta": {"stop_reason": self.stop_reason(), "stop_sequence": self.stopped},
                           "usage": message_usage(self.run.response())})
            yield V1Event({"type": "message_stop"})
        finally:
            self.run.cancel()
