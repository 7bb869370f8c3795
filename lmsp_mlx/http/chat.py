"""POST /v1/chat/completions: OpenAI's Chat Completions API over the same engine, KV
sessions and tool-call continuation as /v1/responses (protocol/chat.py maps the body).

The one thing Chat has that Responses does not is `stop`: the reply ends before the first
stop sequence. The engine ends the turn on the token that completes one (so usage is the
same every time); here the text is cut there, and text that could be the start of one is
held back until it is not, so a stream never shows a stop sequence's first characters.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from quart import Blueprint

from ..protocol.chat import (ChatRequest, chat_param, chat_usage, chunk, completion, completion_id, parse_chat,
                             to_responses)
from ..protocol.item_events import ChatDelta, chat_delta
from ..protocol.logprobs import openai_entries
from ..protocol.problems import Problem
from ..protocol.sse import OpenResponsesEvents, data_frame
from ..service.run import ResponseRun
from ..service.stops import StopScanner
from .auth import requires
from .body import read_json
from .context import start_run
from .sse import loading_stream, needs_load, openai_stream_error, response_start, sse_response

bp = Blueprint("chat", __name__, url_prefix="/v1")


@bp.post("/chat/completions")
@requires("responses:write")
async def create_chat_completion():
    """OpenAI Chat Completions: one choice, sync or streamed as chat.completion.chunk events."""
    chat = parse_chat(await read_json())
    origin: list[int] = []
    try:
        req, origin = to_responses(chat)
        if await needs_load(req.model, chat.stream):  # the stream starts while the model loads, with keep-alives
            return loading_stream(response_start("chat", req, stop=tuple(chat.stops())),
                                  lambda run: ChatReply(run, chat).chunks(),
                                  lambda problem: openai_stream_error(chat_param(problem, origin, chat)))
        run = await start_run("chat", req, stop=tuple(chat.stops()))
    except Problem as problem:
        raise chat_param(problem, origin, chat) from None
    reply = ChatReply(run, chat)
    if not chat.stream:
        return await reply.complete()
    return sse_response(reply.chunks())


class ChatReply:
    def __init__(self, run: ResponseRun, chat: ChatRequest) -> None:
        self.run = run
        self.chat = chat
        self.id = completion_id()
        self.scanner = StopScanner(chat.stops())
        self.stopped = False  # by a stop sequence
        self.calls: list[dict[str, Any]] = []  # as they were sent
        self.reasoning: list[str] = []
        self.logprobs: list[dict[str, Any]] | None = [] if chat.logprobs else None  # the content's entries

    async def deltas(self) -> AsyncIterator[dict[str, Any]]:
        """The choice's deltas (content, reasoning_content, tool_calls) until the turn ends
        or a stop sequence: after that, the events left are drained unseen. Where the
        request asks for logprobs, a delta's `logprobs` holds the entries its content
        finished (taken off before it is sent)."""
        async for e in self.run.events():
            if self.stopped:
                continue
            delta = chat_delta(e)
            if delta is ChatDelta.CONTENT:  # the engine ends the turn on the token that completes a stop
                text, self.stopped = self.scanner.feed(e.delta, e.logprobs)
                if text or self.scanner.logprobs:
                    yield self._content(text)
            elif delta is ChatDelta.REASONING:  # stop sequences apply to the content only
                self.reasoning.append(e.delta)
                yield {"reasoning_content": e.delta}
            elif delta is ChatDelta.FLUSH:
                held = self.scanner.flush()
                if held or self.scanner.logprobs:
                    yield self._content(held)
            elif delta is ChatDelta.TOOL_CALL:
                call = {"id": e.item.call_id, "type": "function",
                        "function": {"name": e.item.name, "arguments": e.item.arguments}}
                self.calls.append(call)
                yield {"tool_calls": [{"index": len(self.calls) - 1, **call}]}

    def _content(self, text: str) -> dict[str, Any]:
        if self.logprobs is None:
            return {"content": text}
        entries = openai_entries(self.scanner.logprobs)
        self.logprobs += entries
        return {"content": text, "logprobs": entries}

    def finish_reason(self) -> str:
        if self.stopped:
            return "stop"
        if self.run.status == "incomplete":
            return "length"
        return "tool_calls" if self.calls else "stop"

    def failure(self) -> Problem | None:
        """Why the run ended without an answer: the generation failed, or the server is
        shutting down."""
        if self.run.status == "failed":
            return self.run.error
        if self.run.status == "cancelled":
            return Problem("internal_error", "the server is shutting down")
        return None

    async def complete(self) -> dict[str, Any]:
        content: list[str] = []
        try:
            async for d in self.deltas():
                content.append(d.get("content", ""))
        finally:
            self.run.cancel()
        if problem := self.failure():
            raise problem
        text = "".join(content)
        return completion(self.id, self.run.response(), text if text or not self.calls else None,
                          "".join(self.reasoning), self.calls, self.finish_reason(), self.logprobs)

    async def chunks(self) -> AsyncIterator[str]:
        """data: frames, as OpenAI streams them (no event names), ending with [DONE]."""
        usage = bool(self.chat.stream_options and self.chat.stream_options.include_usage)
        nothing = None if usage else False  # with include_usage every chunk has `usage`, null until the last

        def data(delta: dict[str, Any] | None, finish: str | None = None, usage: Any = nothing) -> str:
            logprobs = delta.pop("logprobs", None) if delta else None
            return data_frame(chunk(self.id, self.run.created_at, self.chat.model, delta, finish, usage, logprobs))

        try:
            yield data({"role": "assistant", "content": ""})
            async for d in self.deltas():
                yield data(d)
            if problem := self.failure():
                yield data_frame({"error": problem.openai_error()})
            else:
                yield data({}, self.finish_reason())
                if usage:
                    yield data(None, usage=chat_usage(self.run.response()))
            yield OpenResponsesEvents.DONE
        finally:
            self.run.cancel()
