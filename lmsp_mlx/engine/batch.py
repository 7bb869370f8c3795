"""One decode step for every sequence waiting for its next token, and which prompt chunk
runs before it.

The step feeds each sequence's pending token and hands each its own logits row, in one
forward for all where it can:
- the CPU's compiled `batch_step` takes sequences on float32 KV caches (plain, or
  `--kv-bits` quantized ones, whose attention is attention.c's), each on its own cache at
  its own position, the weights read once for the whole batch;
- otherwise (Metal, CUDA, models the compiled step does not know, `--kv-bits` caches)
  sequences are merged into one left-padded batch cache per layer (`Merged`): mlx-lm's
  `BatchKVCache` for plain caches, cache/batch.py's `BatchQuantizedKVCache` for quantized
  ones, whose decode attention is the batched `decode_attention` kernel; kept merged while
  the batch's members stay the same, and extracted back when they change;
- the rest (sliding-window and recurrent caches, a cache of another kind than the
  batch's) step one by one through the model, each on its own cache. Why a sequence
  steps outside the batch is logged once, in one line.

A failure is the failing sequence's alone: a batched call that raises is retried one
sequence at a time (it writes nothing before it can finish), and a sequence whose step or
sampling raises is handed back with its exception while the others go on.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from ..cache.batch import BatchQuantizedKVCache

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
        compiled, merged, alone = _plan(seqs, batch_step)
        for s in compiled:  # a merged member's newest K/V are in the merged cache: hand them back first
            self._merged.release(s)
        runs = ((compiled, lambda group: batch_step([s.pending for s in group], [s.cache for s in group])),
                (merged, lambda group: self._merged.step(self.lm, group)))
        for group, run in runs:
            logits = None
            if group:
                try:
                    logits = run(group)
                except Exception:
                    log.exception("the batched step failed; its %d sequences step one by one", len(group))
                    self._merged.release_all()
            if logits is None:
                alone += group
                continue
            for i, s in enumerate(group):
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


def _plan(seqs: list[Sequence], batch_step) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
    """Which sequences step in the compiled batched step, which merged through MLX, which
    alone. A batch of one row is the model's own pass; merging takes one cache kind at a
    time (the commonest), one token a sequence."""
    if sum(len(s.pending) for s in seqs) == 1:
        return [], [], list(seqs)
    compiled = _commonest(seqs, lambda s: batch_step.kind(s.cache)) if batch_step is not None else []
    rest = [s for s in seqs if not any(s is c for c in compiled)]
    kinds = {id(s): _merge_kind(s) for s in rest}
    merged = _commonest(rest, lambda s: kinds[id(s)])
    if len(merged) == 1:  # one row: its own pass, with no merge
        merged = []
    alone = [s for s in rest if not any(s is m for m in merged)]
    for s in alone:
        if s.alone is None and len(seqs) > 1:
            s.alone = _why_alone(s, kinds[id(s)], batch_step)
            log.info("a sequence steps outside the batch: %s", s.alone)
    if len(compiled) == 1 and len(compiled[0].pending) == 1 and not merged:  # one row: the model's own pass
        return [], [], compiled + alone
    return compiled, merged, alone


def _commonest(seqs: list[Sequence], kind: Callable[[Sequence], tuple | None]) -> list[Sequence]:
    """The sequences of the kind most of them have (None is no kind), in their order."""
    kinds = [kind(s) for s in seqs]
    counts: dict[tuple, int] = {}
    for k in kinds:
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    best = max(counts, key=counts.get) if counts else None
    return [s for s, k in zip(seqs, kinds) if best is not None and k == best]


def _merge_kind(s: Sequence) -> tuple | None:
    """What `Merged` batches this sequence's cache as: plain KVCaches, or QuantizedKVCaches
    of one width and group (merged into BatchQuantizedKVCaches); None for any other cache,
    or more than one pending token (a prompt's tail rides only in the compiled step)."""
    if len(s.pending) != 1:
        return None
    if all(type(c) is KVCache for c in s.cache):
        return ("plain",)
    if all(type(c) is QuantizedKVCache for c in s.cache):
        widths = {(c.bits, c.group_size) for c in s.cache}
        return ("quantized", *widths.pop()) if len(widths) == 1 else None
    return None


def _why_alone(s: Sequence, kind: tuple | None, batch_step) -> str:
    kinds = ", ".join(sorted({type(c).__name__ for c in s.cache}))
    if kind is not None:
        return f"its KV cache ({kinds}) is of another kind than the batch's"
    if len(s.pending) != 1:
        return "its prompt's tail is fed whole"
    compiled = " or a float32 cache the compiled batched step reads" if batch_step is not None else ""
    return (f"its KV cache ({kinds}) is not one that merges into a batch here (plain KVCache, or QuantizedKVCache "
            f"of one width{compiled})")


class Merged:
    """Sequences that decode through MLX in one forward: their caches merged, one per layer,
    into mlx-lm's left-padded `BatchKVCache` (plain caches) or its quantized twin
    `BatchQuantizedKVCache` (cache/batch.py, `--kv-bits`). The merge is kept across steps
    while the members stay the same; when they change, every member's cache is extracted
    back (its own cache, in the session's cache list) and the new members merged."""

    def __init__(self) -> None:
        self.members: list[Sequence] = []
        self.cache: list[BatchKVCache | BatchQuantizedKVCache] = []

    def step(self, lm: LoadedModel, seqs: list[Sequence]) -> mx.array:
        if seqs != self.members:
            self.release_all()
            self.cache = [_batch_of([s.cache[i] for s in seqs]) for i in range(len(seqs[0].cache))]
            self.members = list(seqs)
        tokens = mx.array([s.pending for s in seqs])  # one token each (a prompt's tail rides in the compiled step)
        return lm.model(tokens, cache=self.cache)[:, -1, :]

    def release(self, seq: Sequence) -> None:
        if any(s is seq for s in self.members):
            self.release_all()

    def release_all(self) -> None:
        for i, s in enumerate(self.members):
            s.cache[:] = [c.extract(i) for c in self.cache]  # in place: the session holds this list
        self.members, self.cache = [], []


def _batch_of(caches: list) -> BatchKVCache | BatchQuantizedKVCache:
    return (BatchQuantizedKVCache if type(caches[0]) is QuantizedKVCache else BatchKVCache).merge(caches)


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
