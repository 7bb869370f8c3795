"""One text completion from request to result: the prompt continued as it is (no chat
template), over the same engine and KV sessions as every response (a prompt that repeats
an earlier one's tokens or text reuses its KV), on the one path to the worker every run
takes (service/worker_run.py: the model, the room left in the context, the job and its
pump, leaving when the client does).

Stop sequences work as on Chat (service/stops.py): the engine ends the turn on the token
that completes one, and the text is cut there, held back where it may begin one.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from ..engine.events import Finished, GenerationEvent, PromptLogprobs, TextDelta
from ..engine.generate import GenerationParams
from ..engine.loader import LoadedModel
from ..engine.worker import Engine
from ..protocol.completions import CompletionRequest, completion_id
from ..protocol.logprobs import TokenLogprob
from ..protocol.problems import Problem
from .stops import StopScanner
from .worker_run import WorkerRun, check_room, sampling


Piece = tuple[str, tuple[TokenLogprob, ...]]  # text, and the entries of the tokens it finished


class TextRun(WorkerRun[Piece]):
    """`start` encodes and queues the prompt; `pieces` is the text as it is sampled, cut
    at a stop sequence, with its token entries where `logprobs` asks for them, and
    `finished` the worker's Finished once it is done. With `echo` and `logprobs`,
    `prompt_logprobs` holds the prompt's own entries before the first piece."""

    def __init__(self, engine: Engine, req: CompletionRequest, prefill_step: int, prompt: str | list[int]) -> None:
        super().__init__(engine, completion_id(), req.model)
        self.req = req
        self.prompt = prompt
        self.prefill_step = prefill_step
        self.id = self.name
        self.created = int(time.time())
        self.scanner = StopScanner(req.stops())
        self.stopped = False  # by a stop sequence
        self.prompt_text = ""
        self.finished: Finished | None = None
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()

    async def start(self) -> TextRun:
        """Lease (and load) the model, encode the prompt, queue the job; a refusal lets the model go."""
        try:
            lm = await self.lease()
            if "text" not in lm.capabilities:
                raise Problem("unsupported_capability", f"{self.req.model!r} is an embedding model: it serves "
                              "/v1/embeddings only", param="model")
            tokens, self.prompt_text = await asyncio.to_thread(_encode, lm, self.prompt)
            room = check_room(len(tokens), lm.context_length, "prompt")
            params = GenerationParams(prompt=tokens, max_tokens=min(self.req.max_tokens, room),
                                      prefill_step=self.prefill_step, stop=tuple(self.req.stops()), raw=True,
                                      ignore_eos=self.req.ignore_eos, speculate=self.req.speculate is not False,
                                      logprobs=self.req.logprobs,
                                      prompt_logprobs=self.req.echo and self.req.logprobs is not None,
                                      **sampling(self.req, lm.vocab_size))
        except BaseException:
            self.close()
            raise
        self._submit(params, "completions", text=self.prompt_text)
        return self

    def _fold(self, event: GenerationEvent) -> list[Piece]:
        if isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event.entries
        if isinstance(event, TextDelta) and not self.stopped:
            piece, self.stopped = self.scanner.feed(event.text, event.logprobs)
            return [(piece, self.scanner.logprobs)] if piece or self.scanner.logprobs else []
        if isinstance(event, Finished):
            self.finished = event
            if self.stopped:
                return []
            held = self.scanner.flush()
            return [(held, self.scanner.logprobs)] if held or self.scanner.logprobs else []
        return []

    async def pieces(self) -> AsyncIterator[Piece]:
        """The completion's text; a failure or a shutdown ends it with a Problem."""
        try:
            async for piece in self.events():
                yield piece
        finally:  # the client left (or it ended): stop the worker at its next step
            self.cancel()
        if self.error is not None:
            raise self.error
        if self.status == "cancelled":
            raise Problem("internal_error", "the server is shutting down")

    def finish_reason(self) -> str:
        return "length" if self.finished.reason == "length" and not self.stopped else "stop"


async def start_texts(engine: Engine, req: CompletionRequest, prefill_step: int) -> list[TextRun]:
    """A run for each of the request's prompts, all queued (they decode in one batch); where
    one is refused, those already queued are cancelled and the refusal is the request's."""
    runs: list[TextRun] = []
    try:
        for prompt in req.prompts():
            run = TextRun(engine, req, prefill_step, prompt)
            runs.append(run)
            await run.start()
    except BaseException:
        for run in runs:
            run.cancel()
        raise
    return runs


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
