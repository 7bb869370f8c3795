"""POST /v1/completions: the prompt continued as it is, over the same engine and KV sessions
(a prompt that repeats an earlier one's tokens or text reuses its KV).

Stop sequences work as on Chat (lmsp_mlx/http/chat.py): the engine ends the turn on the token
that completes one, and the text is cut there, held back where it may begin one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from quart import Blueprint

from ..engine.events import Failed, Finished, TextDelta
from ..engine.generate import GenerationParams
from ..engine.loader import LoadedModel
from ..engine.worker import Engine, Job
from ..protocol.completions import CompletionRequest, completion_id, parse_completion, text_completion, usage
from ..protocol.problems import Problem
from .auth import requires
from .chat import StopScanner
from ..protocol.sse import OpenResponsesEvents, data_frame
from ..service.run import sampling
from .body import read_json
from .context import generation_logged, state
from .sse import sse_response

bp = Blueprint("completions", __name__, url_prefix="/v1")


@bp.post("/completions")
@requires("responses:write")
async def create_completion():
    """OpenAI text completions: one choice, sync or streamed as text_completion chunks."""
    req = parse_completion(await read_json())
    s = state()
    lm = s.engine.model
    if req.model != lm.id:
        raise Problem("model_not_found", f"model {req.model!r} is not served here; try {lm.id!r}", param="model")
    tokens, text = await asyncio.to_thread(_encode, lm, req.one_prompt())
    room = lm.context_length - len(tokens)
    if room < 1:
        raise Problem("context_length_exceeded", f"the prompt has {len(tokens)} tokens but the model's context is "
                      f"{lm.context_length} tokens (at least one must remain for the output)", param="prompt")
    params = GenerationParams(prompt=tokens, max_tokens=min(req.max_tokens, room), prefill_step=s.settings.prefill_step,
                              stop=tuple(req.stops()), raw=True, ignore_eos=req.ignore_eos,
                              **sampling(req, lm.vocab_size))
    job = s.engine.submit(params, "completions", text=text)
    generation_logged()
    reply = TextReply(s.engine, job, req, text)
    if not req.stream:
        return await reply.complete()
    return sse_response(reply.chunks())


def _encode(lm: LoadedModel, prompt: str | list[int]) -> tuple[list[int], str]:
    """The prompt's tokens, and its text for the KV lookup by text prefix."""
    if isinstance(prompt, str):
        tokens = lm.tokenizer.encode(prompt)
        if not tokens:
            raise Problem("invalid_request", "the prompt is empty: give the model at least one token", param="prompt")
        return tokens, prompt
    if lm.vocab_size is not None and max(prompt) >= lm.vocab_size:
        raise Problem("invalid_request", f"the prompt holds a token id outside the vocabulary (0..{lm.vocab_size - 1})",
                      param="prompt")
    return list(prompt), lm.tokenizer.decode(prompt)


class TextReply:
    def __init__(self, engine: Engine, job: Job, req: CompletionRequest, prompt_text: str) -> None:
        self.engine = engine
        self.job = job
        self.req = req
        self.id = completion_id()
        self.created = int(time.time())
        self.scanner = StopScanner(req.stops())
        self.stopped = False  # by a stop sequence
        self.prefix = prompt_text if req.echo else ""
        self.ended: Finished | None = None

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it is sampled, cut at a stop sequence; the job's end is kept in `ended`."""
        try:
            async for e in self.job.stream():
                if isinstance(e, TextDelta) and not self.stopped:
                    piece, self.stopped = self.scanner.feed(e.text)
                    if piece:
                        yield piece
                elif isinstance(e, Failed):
                    raise Problem(e.code, e.message)
                elif isinstance(e, Finished):
                    self.ended = e
            if not self.stopped and (held := self.scanner.flush()):
                yield held
        finally:  # the client left: stop the worker at its next step
            if not self.job.ended:
                self.job.cancel()
                self.engine.withdraw(self.job)
        if self.ended.reason == "cancelled":
            raise Problem("internal_error", "the server is shutting down")

    def finish_reason(self) -> str:
        return "length" if self.ended.reason == "length" and not self.stopped else "stop"

    def usage(self) -> dict[str, Any]:
        u = self.ended.usage
        return usage(u.input_tokens, u.output_tokens, u.cached_tokens)

    async def complete(self) -> dict[str, Any]:
        text = "".join([piece async for piece in self.pieces()])
        return text_completion(self.id, self.created, self.req.model, self.prefix + text, self.finish_reason(),
                               self.usage())

    async def chunks(self) -> AsyncIterator[str]:
        """data: frames, as OpenAI streams them (no event names), ending with [DONE]."""
        def data(text: str, finish: str | None = None) -> str:
            return data_frame(text_completion(self.id, self.created, self.req.model, text, finish))

        if self.prefix:
            yield data(self.prefix)
        try:
            async for piece in self.pieces():
                yield data(piece)
        except Problem as problem:
            yield data_frame({"error": problem.openai_error()})
        else:
            yield data("", self.finish_reason())
            if self.req.stream_options and self.req.stream_options.include_usage:
                chunk = text_completion(self.id, self.created, self.req.model, "", None, self.usage(), choices=False)
                yield data_frame(chunk)
        yield OpenResponsesEvents.DONE
