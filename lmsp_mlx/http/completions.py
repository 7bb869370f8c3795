"""POST /v1/completions: OpenAI's text completions, framed from TextRuns (each prompt
continued as it is: service/text_run.py), sync or streamed as text_completion chunks. A
request with several prompts (OpenAI's batch form) has a choice for each, `index` in
prompt order; their runs decode in one batch, and a stream interleaves their chunks."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from quart import Blueprint

from ..protocol.completions import CompletionRequest, parse_completion, text_choice, text_completion, usage
from ..protocol.logprobs import completion_logprobs
from ..protocol.problems import Problem
from ..protocol.sse import OpenResponsesEvents, data_frame
from ..service.text_run import TextRun, start_texts
from .auth import requires
from .body import read_json
from .context import generation_logged, state
from .sse import loading_stream, needs_load, openai_stream_error, sse_response

bp = Blueprint("completions", __name__, url_prefix="/v1")


@bp.post("/completions")
@requires("responses:write")
async def create_completion():
    """OpenAI text completions: a choice per prompt, sync or streamed as text_completion chunks."""
    req = parse_completion(await read_json())
    s = state()

    def start():
        return start_texts(s.engine, req, s.settings.engine.prefill_chunk)

    if await needs_load(req.model, req.stream):  # the stream starts while the model loads, with keep-alives
        return loading_stream(start, lambda runs: Completion(runs, req).chunks(), openai_stream_error)
    runs = await start()
    generation_logged()
    reply = Completion(runs, req)
    if not req.stream:
        return await reply.complete()
    return sse_response(reply.chunks())


class Choice:
    """One prompt's run as a choice; `echo` puts the prompt first, and with `logprobs` its
    tokens' entries first (the text echoed is then their texts joined, the prompt as the
    tokenizer reads it back, so that the entries join to the text exactly)."""

    def __init__(self, run: TextRun, req: CompletionRequest, index: int) -> None:
        self.run = run
        self.req = req
        self.index = index
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

    async def complete(self) -> dict[str, Any]:
        pieces = [piece async for piece in self.run.pieces()]
        text, entries = self.prefix()
        text += "".join(t for t, _ in pieces)
        entries += [e for _, es in pieces for e in es]
        return text_choice(self.index, text, self.run.finish_reason(), self._logprobs(entries))

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """This choice's streamed chunks; a failure raises its Problem."""
        echoed = not self.req.echo
        async for piece, entries in self.run.pieces():
            if not echoed:  # the prompt's entries are known once the first piece has come
                echoed = True
                text, prompt = self.prefix()
                yield text_choice(self.index, text, None, self._logprobs(prompt))
            yield text_choice(self.index, piece, None, self._logprobs(list(entries)))
        if not echoed:  # nothing was generated (max_tokens 0): the prompt alone
            text, prompt = self.prefix()
            yield text_choice(self.index, text, None, self._logprobs(prompt))
        yield text_choice(self.index, "", self.run.finish_reason())


class Completion:
    def __init__(self, runs: list[TextRun], req: CompletionRequest) -> None:
        self.runs = runs
        self.req = req
        self.choices = [Choice(run, req, i) for i, run in enumerate(runs)]
        self.id = runs[0].id
        self.created = runs[0].created

    def usage(self) -> dict[str, Any]:
        done = [r.finished.usage for r in self.runs]
        return usage(sum(u.input_tokens for u in done), sum(u.output_tokens for u in done),
                     sum(u.cached_tokens for u in done))

    async def complete(self) -> dict[str, Any]:
        try:
            choices = await asyncio.gather(*(c.complete() for c in self.choices))
        finally:
            self.cancel()
        return text_completion(self.id, self.created, self.req.model, list(choices), self.usage())

    async def chunks(self) -> AsyncIterator[str]:
        """data: frames, as OpenAI streams them (no event names), the choices' chunks as they
        come, ending with [DONE]."""
        frames: asyncio.Queue[dict[str, Any] | Problem | None] = asyncio.Queue()

        async def feed(choice: Choice) -> None:
            try:
                async for c in choice.chunks():
                    await frames.put(c)
            except Problem as problem:
                await frames.put(problem)
            finally:
                await frames.put(None)

        tasks = [asyncio.get_running_loop().create_task(feed(c)) for c in self.choices]
        failed = False
        try:
            left = len(tasks)
            while left:
                item = await frames.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Problem):
                    failed = True
                    yield data_frame({"error": item.openai_error()})
                else:
                    yield data_frame(text_completion(self.id, self.created, self.req.model, [item]))
            if not failed and self.req.stream_options and self.req.stream_options.include_usage:
                yield data_frame(text_completion(self.id, self.created, self.req.model, [], self.usage()))
            yield OpenResponsesEvents.DONE
        finally:
            for t in tasks:
                t.cancel()
            self.cancel()

    def cancel(self) -> None:
        """The client left (or it ended): stop every run at its next step."""
        for run in self.runs:
            run.cancel()
