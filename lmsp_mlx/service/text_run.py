"""One text completion from request to result: the prompt continued as it is (no chat
template), over the same engine and KV sessions as every response (a prompt that repeats
an earlier one's tokens or text reuses its KV), with the checks every run makes
(service/run.py: the model, the room left in the context, leaving when the client does).

Stop sequences work as on Chat (service/stops.py): the engine ends the turn on the token
that completes one, and the text is cut there, held back where it may begin one.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from ..engine.events import Failed, Finished, TextDelta
from ..engine.generate import GenerationParams
from ..engine.loader import LoadedModel
from ..engine.worker import Engine
from ..protocol.completions import CompletionRequest, completion_id
from ..protocol.problems import Problem
from .run import check_model, check_room, sampling, stop_job
from .stops import StopScanner


class TextRun:
    """`start` encodes and queues the prompt; `pieces` is the text as it is sampled, cut
    at a stop sequence, and `ended` the worker's Finished once it is done."""

    def __init__(self, engine: Engine, req: CompletionRequest, prefill_step: int) -> None:
        check_model(engine.model, req.model)
        self.engine = engine
        self.req = req
        self.prefill_step = prefill_step
        self.id = completion_id()
        self.created = int(time.time())
        self.scanner = StopScanner(req.stops())
        self.stopped = False  # by a stop sequence
        self.prompt_text = ""
        self.job = None
        self.ended: Finished | None = None

    async def start(self) -> None:
        lm = self.engine.model
        tokens, self.prompt_text = await asyncio.to_thread(_encode, lm, self.req.one_prompt())
        room = check_room(len(tokens), lm.context_length, "prompt")
        params = GenerationParams(prompt=tokens, max_tokens=min(self.req.max_tokens, room),
                                  prefill_step=self.prefill_step, stop=tuple(self.req.stops()), raw=True,
                                  ignore_eos=self.req.ignore_eos, **sampling(self.req, lm.vocab_size))
        self.job = self.engine.submit(params, "completions", text=self.prompt_text)

    async def pieces(self) -> AsyncIterator[str]:
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
                stop_job(self.engine, self.job)
        if self.ended.reason == "cancelled":
            raise Problem("internal_error", "the server is shutting down")

    def finish_reason(self) -> str:
        return "length" if self.ended.reason == "length" and not self.stopped else "stop"


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
