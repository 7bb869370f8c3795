"""POST /v1/completions: OpenAI's text completions, framed from a TextRun (the prompt
continued as it is: service/text_run.py), sync or streamed as text_completion chunks."""

from __future__ import annotations

from typing import Any, AsyncIterator

from quart import Blueprint

from ..protocol.completions import CompletionRequest, parse_completion, text_completion, usage
from ..protocol.logprobs import completion_logprobs
from ..protocol.problems import Problem
from ..protocol.sse import OpenResponsesEvents, data_frame
from ..service.text_run import TextRun
from .auth import requires
from .body import read_json
from .context import generation_logged, state
from .sse import loading_stream, needs_load, openai_stream_error, sse_response

bp = Blueprint("completions", __name__, url_prefix="/v1")


@bp.post("/completions")
@requires("responses:write")
async def create_completion():
    """OpenAI text completions: one choice, sync or streamed as text_completion chunks."""
    req = parse_completion(await read_json())
    s = state()
    run = TextRun(s.engine, req, s.settings.engine.prefill_chunk)
    if await needs_load(req.model, req.stream):  # the stream starts while the model loads, with keep-alives
        return loading_stream(run.start, lambda run: TextReply(run, req).chunks(), openai_stream_error)
    await run.start()
    generation_logged()
    reply = TextReply(run, req)
    if not req.stream:
        return await reply.complete()
    return sse_response(reply.chunks())


class TextReply:
    """A TextRun in OpenAI's text completion shape; `echo` puts the prompt first, and with
    `logprobs` its tokens' entries first (the text echoed is then their texts joined, the
    prompt as the tokenizer reads it back, so that the entries join to the text exactly)."""

    def __init__(self, run: TextRun, req: CompletionRequest) -> None:
        self.run = run
        self.req = req
        self.id = run.id
        self.created = run.created
        self.logprobs = req.logprobs is not None
        self.offset = 0  # text_offset of the next token

    def prefix(self) -> tuple[str, list]:
        """The echoed prompt and its entries (known once the first piece has come)."""
        if not self.req.echo:
            return "", []
        if self.logprobs:
            entries = list(self.run.prompt_logprobs)
            return "".join(e.token for e in entries), entries
        return self.run.prompt_text, []

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        out = completion_logprobs(entries, self.offset)
        self.offset += sum(len(e.token) for e in entries)
        return out

    def usage(self) -> dict[str, Any]:
        u = self.run.finished.usage
        return usage(u.input_tokens, u.output_tokens, u.cached_tokens)

    async def complete(self) -> dict[str, Any]:
        pieces = [piece async for piece in self.run.pieces()]
        text, entries = self.prefix()
        text += "".join(t for t, _ in pieces)
        entries += [e for _, es in pieces for e in es]
        return text_completion(self.id, self.created, self.req.model, text, self.run.finish_reason(),
                               self.usage(), logprobs=self._logprobs(entries))

    async def chunks(self) -> AsyncIterator[str]:
        """data: frames, as OpenAI streams them (no event names), ending with [DONE]."""
        def data(text: str, finish: str | None = None, entries: list | None = None) -> str:
            logprobs = self._logprobs(entries) if entries is not None else None
            return data_frame(text_completion(self.id, self.created, self.req.model, text, finish, logprobs=logprobs))

        echoed = not self.req.echo
        try:
            async for piece, entries in self.run.pieces():
                if not echoed:  # the prompt's entries are known once the first piece has come
                    echoed = True
                    text, prompt = self.prefix()
                    yield data(text, entries=prompt)
                yield data(piece, entries=list(entries))
        except Problem as problem:
            yield data_frame({"error": problem.openai_error()})
        else:
            if not echoed:  # nothing was generated (max_tokens 0): the prompt alone
                text, prompt = self.prefix()
                yield data(text, entries=prompt)
            yield data("", self.run.finish_reason())
            if self.req.stream_options and self.req.stream_options.include_usage:
                chunk = text_completion(self.id, self.created, self.req.model, "", None, self.usage(), choices=False)
                yield data_frame(chunk)
        yield OpenResponsesEvents.DONE
