"""One decode step for every sequence waiting for its next token, and which prompt chunk
runs before it.

The step feeds each sequence's pending token and hands each its own logits row, in one
forward for all where it can:
- the CPU's compiled `batch_step` takes sequences on plain float32 KV caches, each on its
  own cache at its own position, the weights read once for the whole batch;
- otherwise (Metal, CUDA, models the compiled step does not know) sequences on plain
  `KVCache`s are merged into mlx-lm's `BatchKVCache` (`Merged`), kept merged while the
  batch's members stay the same, and extracted back when they change;
- the rest (a `--kv-bits` cache where the compiled step is not there, sliding-window and
  recurrent caches) step one by one through the model, each on its own cache. Why a
  sequence steps outside the batch is logged once, in one line.

A failure is the failing sequence's alone: a batched call that raises is retried one
sequence at a time (it writes nothing before it can finish), and a sequence whose step or
sampling raises is handed back with its exception while the others go on.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .events import Finished, GenerationEvent
from .generate import GenerationParams
from .loader import LoadedModel
from .sequence import Phase, Sequence

log = logging.getLogger("lmsp_mlx.engine")


def next_prefill(seqs: list[Sequence]) -> Sequence | None:
    """The sequence whose prompt chunk runs this step: the one with the least prompt left
    (a short request's first token does not wait behind a long prompt's chunks), the
    earliest of equals. A long prompt still advances whenever no shorter one waits, and
    at most `--max-batch` requests run, so none waits forever."""
    waiting = [s for s in seqs if s.phase is Phase.PREFILL]
    return min(waiting, key=lambda s: s.to_prefill) if waiting else None


def chunk_size(seq: Sequence, chunk: int, others: bool) -> int:
    """How many of `seq`'s prompt tokens run this step, `chunk` being `--prefill-chunk`.
    - A short request, one whose new prompt is at most two chunks, runs whole: its first
      token does not wait for a decode step between its chunks.
    - A longer one, while other sequences are in the batch, runs half chunks: a short
      request that arrives waits at most half a chunk for the one in flight, and the
      running streams at most half a chunk per step.
    - Alone, a chunk.
    Measured against one `chunk` for every prompt (benchmarks/concurrency.py --widths 8
    --requests 32, two alternating pairs): the p95 time to first token of prompts <= 500
    tokens went from 3.88 and 3.60 s to 2.82 and 3.01 s, at 32.4 against 33.1 tok/s."""
    if len(seq.params.prompt) - seq.params.cached <= 2 * chunk:
        return seq.to_prefill
    return max(1, chunk // 2) if others else chunk


class Batch:
    """The decode side of the worker's batch. `step` feeds every decoding sequence its
    pending token; `release` hands a sequence's cache back in its own form before the
    session pool records it (a sequence that ends, fails or is cancelled)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self._merged = Merged()

    def release(self, seq: Sequence) -> None:
        self._merged.release(seq)

    def step(self, seqs: list[Sequence]) -> dict[Sequence, Exception]:
        """One token for each of `seqs`; returns the sequences that failed, with why."""
        failed: dict[Sequence, Exception] = {}
        batch_step = getattr(self.lm.model, "batch_step", None)
        together, alone = [], []
        rows = sum(len(s.pending) for s in seqs)
        for s in seqs:
            why = None if rows == 1 else _why_alone(batch_step, s)
            (alone if why else together).append(s)
            if why and s.alone is None:
                s.alone = why
                log.info("a sequence steps outside the batch: %s", why)
        logits = None
        if sum(len(s.pending) for s in together) > 1:
            try:
                if batch_step is not None:
                    logits = batch_step([s.pending for s in together], [s.cache for s in together])
                elif len(together) == 1:  # one sequence's rows: the model's own pass
                    logits = None
                else:
                    logits = self._merged.step(self.lm, together)
            except Exception:
                log.exception("the batched step failed; its %d sequences step one by one", len(together))
                self._merged.release_all()
        if logits is None:
            alone = together + alone
        else:
            for i, s in enumerate(together):
                _take(s, logits[i : i + 1], failed)
        for s in alone:
            self._merged.release(s)
            try:
                logits = self.lm.model(mx.array([s.pending]), cache=s.cache)[:, -1, :]
            except Exception as exc:
                failed[s] = exc
                continue
            _take(s, logits, failed)
        return failed


class Merged:
    """Sequences that decode through MLX in one forward: their plain KVCaches merged into
    mlx-lm's left-padded `BatchKVCache`s, one per layer. The merge is kept across steps
    while the members stay the same; when they change, every member's cache is extracted
    back (its own `KVCache`, in the session's cache list) and the new members merged."""

    def __init__(self) -> None:
        self.members: list[Sequence] = []
        self.cache: list[BatchKVCache] = []

    def step(self, lm: LoadedModel, seqs: list[Sequence]) -> mx.array:
        if seqs != self.members:
            self.release_all()
            self.cache = [BatchKVCache.merge([s.cache[i] for s in seqs]) for i in range(len(seqs[0].cache))]
            self.members = list(seqs)
        tokens = mx.array([s.pending for s in seqs])  # one token each (no batched step: tails go whole)
        return lm.model(tokens, cache=self.cache)[:, -1, :]

    def release(self, seq: Sequence) -> None:
        if any(s is seq for s in self.members):
            self.release_all()

    def release_all(self) -> None:
        for i, s in enumerate(self.members):
            s.cache[:] = [c.extract(i) for c in self.cache]  # in place: the session holds this list
        self.members, self.cache = [], []


def _why_alone(batch_step, s: Sequence) -> str | None:
    kinds = ", ".join(sorted({type(c).__name__ for c in s.cache}))
    if batch_step is not None and not batch_step.takes(s.cache):
        return f"its KV cache ({kinds}) is not the plain float32 cache the compiled batched step reads"
    if batch_step is None and any(type(c) is not KVCache for c in s.cache):
        return f"its KV cache ({kinds}) is not one mlx-lm merges into a batch here (plain KVCache only)"
    return None


def _take(s: Sequence, logits: mx.array, failed: dict[Sequence, Exception]) -> None:
    try:
        s.take(logits)
    except Exception as exc:  # a grammar, a detokenizer, a client's callback: this sequence's alone
        failed[s] = exc


def generate(lm: LoadedModel, params: GenerationParams, emit: Callable[[GenerationEvent], None],
             cancelled: Callable[[], bool] = lambda: False, cache: list | None = None,
             sampled: list[int] | None = None, whole: Callable[[], bool] = lambda: False) -> Finished:
    """One reply on its own, through the same steps the worker's batch takes: prefill
    `params.prompt` after its cached part into `cache` (a new one if None), then decode.
    Benchmarks, tests and tools use it; the server's requests go through the worker."""
    seq = Sequence(lm, params, make_prompt_cache(lm.model) if cache is None else cache, emit, whole=whole,
                   sampled=[] if sampled is None else sampled)
    batch = Batch(lm)
    while seq.phase is not Phase.DONE:
        if cancelled():
            return seq.cancel()
        if seq.phase is Phase.PREFILL:
            seq.prefill_chunk(params.prefill_step)
        elif seq in (failed := batch.step([seq])):
            raise failed[seq]
    return seq.result
