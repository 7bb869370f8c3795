"""One embeddings request: the model leased (loaded on demand like any other), the inputs
tokenised and checked, then embedded on the worker thread in batches of similar length
(engine/embed.py), between the decode steps of whatever else runs. A batch holds at most
`--prefill-chunk` padded tokens, and a decoder's longer input runs a chunk a call, so an
embeddings request holds the streams beside it no longer than a prompt chunk does."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from ..engine.embed import LM_POOLING, Chunked, batches, embed, states_of
from ..engine.encoder import Encoder
from ..engine.loader import LoadedModel
from ..engine.worker import Engine
from ..protocol.embeddings import EmbeddingRequest, embedding_list
from ..protocol.problems import Problem
from .worker_run import acquire

log = logging.getLogger("lmsp_mlx.server")


async def create_embeddings(engine: Engine, req: EmbeddingRequest, chunk: int) -> dict:
    if engine.distributed:
        raise Problem("unsupported_capability", "embeddings are not served while the model is split over ranks",
                      param="model")
    slot = await acquire(engine, req.model)
    try:
        lm = slot.lm
        try:
            states = states_of(lm.model)
        except ValueError as exc:
            raise Problem("unsupported_capability", f"{req.model!r} cannot embed: {exc}", param="model") from None
        inputs = await asyncio.to_thread(_tokens, lm, req)
        spec = lm.embedding or LM_POOLING
        began = time.perf_counter()
        vectors: list[list[float] | None] = [None] * len(inputs)
        groups, calls = batches(inputs, chunk), 0
        for group in groups:  # one worker call each: decode steps of other requests run between them
            if len(inputs[group[0]]) > chunk and not isinstance(lm.model, Encoder):
                long = Chunked(lm.model, inputs[group[0]], spec)
                while not long.done:
                    await engine.call(lambda: long.step(chunk))
                    calls += 1
                vectors[group[0]] = long.vector()
                continue
            out = await engine.call(lambda g=group: embed(states, [inputs[i] for i in g], spec))
            calls += 1
            for i, v in zip(group, out):
                vectors[i] = v
    finally:
        engine.release(slot)
    tokens = sum(len(t) for t in inputs)
    log.info("embeddings model=%s inputs=%d tokens=%d passes=%d pooling=%s%s in %.2fs", req.model, len(inputs),
             tokens, calls, spec.pooling, " normalised" if spec.normalize else "", time.perf_counter() - began)
    if req.dimensions is not None:
        width = len(vectors[0])
        if req.dimensions > width:
            raise Problem("invalid_request", f"dimensions is {req.dimensions} but {req.model!r} gives vectors of "
                          f"{width}", param="dimensions")
        vectors = [_shortened(v, req.dimensions, spec.normalize) for v in vectors]
    return embedding_list(req.model, vectors, req.encoding_format, tokens)


def _tokens(lm: LoadedModel, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's tokens, within the vocabulary and the model's context."""
    out = []
    for n, one in enumerate(req.inputs()):
        where = f"input[{n}]" if req.listed else "input"
        tokens = lm.tokenizer.encode(one) if isinstance(one, str) else list(one)
        if not tokens:
            raise Problem("invalid_request", "an input gives no tokens", param=where)
        if lm.vocab_size is not None and max(tokens) >= lm.vocab_size:
            raise Problem("invalid_request", f"a token id is outside the vocabulary (0..{lm.vocab_size - 1})",
                          param=where)
        if len(tokens) > lm.context_length:
            raise Problem("context_length_exceeded", f"an input has {len(tokens)} tokens but the model's context is "
                          f"{lm.context_length}", param=where)
        out.append(tokens)
    return out


def _shortened(v: list[float], n: int, normalize: bool) -> list[float]:
    """The first n values (a Matryoshka-style shortening), of length 1 again where normalised."""
    head = v[:n]
    if not normalize:
        return head
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]
