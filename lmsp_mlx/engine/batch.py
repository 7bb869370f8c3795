"""One decode step for every sequence waiting for its next token, and which prompt chunk
runs before it.

The step feeds each sequence's pending token and hands each its own logits row, in one
forward for all where it can:
- the compiled CPU runner's `batch` step takes sequences on float32 KV caches (plain, or
  `--kv-bits` quantized ones, whose attention is attention.c's), each on its own cache at
  its own position, the weights read once for the whole batch;
- otherwise (Metal, CUDA, models the compiled step does not know, `--kv-bits` caches)
  sequences are merged into one batch cache per layer (`Merged`), each layer in the batch
  form of its own kind (`merge_layer`): mlx-lm's `BatchKVCache` for plain caches (MLA's
  included), `BatchRotatingKVCache` for sliding-window ones, `ArraysCache` rows for
  recurrent state, a `CacheList` of batches for a layer holding several caches, and
  cache/batch.py's `BatchQuantizedKVCache` for quantized ones (whose decode attention is
  the batched `decode_attention` kernel). A model that mixes kinds across its layers
  (gpt-oss, Gemma 3, Qwen3-Next, Nemotron-H) batches each layer in its own kind. The merge
  is kept across steps, and a join or leave copies only that sequence: a leaver's row is
  extracted and left free, a joiner written into a free row (`Merged`);
- the rest (a cache kind with no batch form, a cache of another layout than the batch's)
  step one by one through the model, each on its own cache. Why a sequence steps outside
  the batch is logged once, in one line.

A failure is the failing sequence's alone: a batched call that raises is retried one
sequence at a time (it writes nothing before it can finish), and a sequence whose step or
sampling raises is handed back with its exception while the others go on.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache,
    make_prompt_cache,
)

from ..cache.batch import BatchQuantizedKVCache, fits, write_row

from .events import Finished, GenerationEvent
from .generate import GenerationParams
from .loader import LoadedModel
from .sequence import Phase, Sequence, sample_rows
from .speculate import Drafting, rewind, rollback_plan, snapshot

log = logging.getLogger("lmsp_mlx.engine")

# LMSP_PREFILL_TOGETHER=0 prefills every prompt alone (benchmarks/prompt_batching.py
# compares); read once, not on every step.
PREFILL_TOGETHER = os.environ.get("LMSP_PREFILL_TOGETHER", "1") != "0"

# Recurrent layers (ArraysCache) keep a right-padded prompt's state only where the model's
# mixer reads the cache's `lengths`. Checked per family against each prompt alone
# (tests/test_families.py, logprobs included): mlx-lm 0.32's nemotron_h hands ssm_update
# its mask but not the lengths, so a shorter prompt's SSM state came out as the padding's
# (logprobs off by up to 0.49 where alone they match exactly). A recurrent family not
# listed here prefills its prompts one at a time until it is checked.
PADDED_PREFILL_RECURRENT = frozenset({"qwen3_next", "qwen3_5", "kimi_linear"})


def pads_safely(lm: LoadedModel, kinds: tuple) -> bool:
    """Whether prompts whose caches have these layer kinds may prefill together, right-padded."""
    return lm.model_type in PADDED_PREFILL_RECURRENT or not any(k is not None and k[0] == "arrays" for k in kinds)


def log_prefill_alone(lm: LoadedModel) -> None:
    """At load: one line where this model's prompts never prefill together (and why)."""
    if "text" in lm.capabilities and lm.runner.kind == "mlx" and PREFILL_TOGETHER and \
            not pads_safely(lm, tuple(layer_kind(c) for c in make_prompt_cache(lm.model))):
        log.info("prompts of %s prefill one at a time: its recurrent layers (%s) are not checked to keep a "
                 "right-padded prompt's state (engine/batch.py PADDED_PREFILL_RECURRENT)", lm.id, lm.model_type)


# The most rows a decode step carries with drafts: a step is bound by reading the weights
# until its rows' arithmetic takes over, and past that a drafted row costs about what it
# saves. Measured on SmolLM2 float32 (benchmarks/speculative.py): drafts of 4 for each of 8
# streams made the aggregate 0.91x of none; a few rows beside 1 stream, 2.06x.
DRAFT_ROWS = 12


def next_prefill(seqs: list[Sequence]) -> Sequence | None:
    """The sequence whose prompt chunk runs this step: the one with the least prompt left
    (a short request's first token does not wait behind a long prompt's chunks), the
    earliest of equals. A long prompt still advances whenever no shorter one waits, and
    at most `--max-batch` requests run, so none waits forever."""
    waiting = [s for s in seqs if s.phase is Phase.PREFILL]
    return min(waiting, key=lambda s: s.to_prefill) if waiting else None


def prefill_group(seqs: list[Sequence], chunk: int, lm: LoadedModel) -> list[Sequence]:
    """The prompts that prefill together in this step: those whose whole rest (all but the
    last token) fits in one `chunk`, with caches that merge alike (the commonest kind), as
    mlx-lm's prompt batching takes them. Empty unless at least two qualify, and on the
    compiled CPU runner: its batched step takes short suffixes as rows, and its compiled
    prefill, one prompt at a time, beat MLX's batched forward (a llama at 4 streams with
    the compiled decode off: 0.84-0.93x mlx_lm.server batched, 1.04-1.07x alone).
    Quantized caches are left out: their batch form has no right padding (`prepare`)."""
    if lm.runner.kind != "mlx" or not PREFILL_TOGETHER:
        return []
    short = [s for s in seqs if s.phase is Phase.PREFILL and s.together and s.params.max_tokens > 0
             and 1 <= len(s.params.prompt) - 1 - s.cursor <= chunk]
    if len(short) < 2:
        return []
    kinds = {id(s): tuple(layer_kind(c) for c in s.cache) for s in short}
    group = _commonest(short, lambda s: None if any(k is None or k[0] == "quantized" for k in kinds[id(s)])
                       else kinds[id(s)])
    return group if len(group) > 1 and pads_safely(lm, kinds[id(group[0])]) else []


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

    def prefill(self, seqs: list[Sequence]) -> None:
        """Run the rest of each of `seqs`' prompts (a `prefill_group`: all but the last token)
        in one forward, their caches merged layer by layer (`merge_layer`) and the rows right-
        padded to the longest, as mlx-lm's prompt batching does (`prepare`, then `finalize`
        moves the padding left). Each sequence gets its row back in its own cache and waits
        for its first token in the next decode step, its last prompt token pending: the
        prompts that arrive together get their first tokens from one forward and one step.
        Their own caches are not touched until the forward is done: where it raises, each
        is left as it was, marked to prefill alone, and the failure is logged."""
        feeds = [s.params.prompt[s.cursor : -1] for s in seqs]
        lengths = [len(f) for f in feeds]
        width = max(lengths)
        try:
            cache = [merge_layer([s.cache[i] for s in seqs]) for i in range(len(seqs[0].cache))]
            for c in cache:
                c.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
            self.lm.runner.prefill(mx.array([f + [0] * (width - len(f)) for f in feeds]), cache)
            for c in cache:
                c.finalize()
            rows = [[c.extract(i) for c in cache] for i in range(len(seqs))]
            mx.eval([a for _, a in tree_flatten([[c.state for c in row] for row in rows]) if isinstance(a, mx.array)])
        except Exception:
            log.exception("a batched prefill of %d prompts failed; each prefills alone", len(seqs))
            for s in seqs:
                s.together = False
            return
        log.info("prefill: %d prompts in one forward (%d tokens, rows padded to %d)", len(seqs), sum(lengths), width)
        for s, row in zip(seqs, rows):
            s.cache[:] = row  # in place: the session holds this list
            s.prefilled_but_last()

    def step(self, seqs: list[Sequence]) -> dict[Sequence, Exception]:
        """One token for each of `seqs`, more for a sequence whose draft the step verifies;
        returns the sequences that failed, with why."""
        failed: dict[Sequence, Exception] = {}
        batch_step = self.lm.runner.batch
        drafts = self._drafts(seqs, batch_step)
        compiled, merged, alone = _plan(seqs, batch_step, drafts)
        for s in merged:  # a merged batch feeds one token a row: a draft drawn for it is dropped
            drafts.pop(s, None)
        for s in compiled:  # a merged member's newest K/V are in the merged cache: hand them back first
            self._merged.release(s)
        runs = ((compiled, lambda group: batch_step([s.pending + drafts.get(s, []) for s in group],
                                                    [s.cache for s in group],
                                                    every=[s in drafts for s in group])),
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
                for s in group:  # one by one they verify no draft: their own pass, as without speculation
                    drafts.pop(s, None)
                alone += group
                continue
            self._settle(group, logits, drafts, failed)
        for s in alone:
            self._merged.release(s)
            self._step_alone(s, drafts.get(s, []), failed)
        return failed

    def _drafts(self, seqs: list[Sequence], batch_step) -> dict[Sequence, list[int]]:
        """This step's drafts, by sequence. A draft rides where verifying it costs rows, not
        a pass: in the compiled batched step, each sequence with its own number of rows; on
        the MLX runner, for a sequence that decodes alone (in a merged batch every row would
        have to carry the longest draft). A cache with a layer that can give refused rows
        back neither way (`rollback_plan`) drafts nothing. The step's rows stay within
        DRAFT_ROWS: a wide batch drafts little or nothing."""
        drafts: dict[Sequence, list[int]] = {}
        most = (DRAFT_ROWS - len(seqs)) // max(1, len(seqs))
        if most < 1:
            return drafts
        for s in seqs:
            if s.drafting is None or len(s.pending) != 1:
                continue
            if not (batch_step is not None and batch_step.takes(s.cache) or len(seqs) == 1):
                continue
            if (draft := s.draft(most)) and rollback_plan(s.cache, 1 + len(draft)) is not None:
                drafts[s] = draft
        return drafts

    def _settle(self, group: list[Sequence], logits: mx.array, drafts: dict[Sequence, list[int]],
                failed: dict[Sequence, Exception]) -> None:
        """Hand each sequence of a batched step its rows of `logits`: one row each, or one
        more per drafted token for a sequence that drafted (`every` in the compiled step)."""
        plain, rows, at = [], [], 0
        for s in group:
            draft = drafts.get(s, [])
            if draft:
                self._verify(s, s.pending + draft, logits[at : at + 1 + len(draft)], failed, saved=None)
            else:
                plain.append(s)
                rows.append(at)
            at += 1 + len(draft)
        if plain:
            picked = logits if len(rows) == logits.shape[0] else logits[mx.array(rows)]
            for k, (s, token) in enumerate(zip(plain, sample_rows(plain, picked))):
                _take_token(s, token, failed, picked[k : k + 1])

    def _step_alone(self, s: Sequence, draft: list[int], failed: dict[Sequence, Exception]) -> None:
        """`s` through the model's own pass on its own cache, its draft's rows included."""
        fed = s.pending + draft
        saved = snapshot(s.cache) if draft and rollback_plan(s.cache, len(fed)) == "rerun" else None
        try:
            logits = self.lm.runner.forward(mx.array([fed]), s.cache)
        except Exception as exc:
            failed[s] = exc
            return
        if draft:
            self._verify(s, fed, logits[0], failed, saved)
        else:
            _take(s, logits[:, -1, :], failed)

    def _verify(self, s: Sequence, fed: list[int], logits: mx.array, failed: dict[Sequence, Exception],
                saved: list | None) -> None:
        """Take the tokens of a drafted run (`Sequence.take_drafted`), then give back the
        cache rows of refused draft tokens: trimmed, or, where recurrent layers hold state
        (`saved`: their state before the step), every fed row dropped, that state put back
        and the accepted tokens run again."""
        try:
            kept = s.take_drafted(logits, fed[1:])
        except Exception as exc:  # a grammar, a detokenizer, a client's callback: this sequence's alone
            failed[s] = exc
            return
        if kept == len(fed):
            return
        try:
            if saved is None:
                rewind(s.cache, len(fed) - kept, None)
                return
            rewind(s.cache, len(fed), saved)
            self.lm.runner.prefill(mx.array([fed[:kept]]), s.cache)
        except Exception as exc:
            failed[s] = exc


def _plan(seqs: list[Sequence], batch_step,
          drafts: dict[Sequence, list[int]]) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
    """Which sequences step in the compiled batched step, which merged through MLX, which
    alone. A batch of one row is the model's own pass; merging takes one cache kind at a
    time (the commonest), one token a sequence. A draft's rows ride in the compiled step
    where the sequence's cache is one it takes (`Batch._drafts`)."""
    if sum(len(s.pending) + len(drafts.get(s, ())) for s in seqs) == 1:
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
    if len(compiled) == 1 and len(compiled[0].pending) == 1 and compiled[0] not in drafts and not merged:
        # one row: the model's own pass
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
    """What `Merged` batches this sequence's cache as: each layer's kind (`layer_kind`), so
    only sequences whose layers merge alike share a batch; None where a layer has no batch
    form, or more than one token is pending (a prompt's tail rides only in the compiled step)."""
    if len(s.pending) != 1:
        return None
    kinds = tuple(layer_kind(c) for c in s.cache)
    return None if None in kinds else kinds


def layer_kind(c) -> tuple | None:
    """A layer cache's batch kind: what must be equal for two of them to merge. Exact types,
    not subclasses: a subclass may keep its state in ways the batch form does not know."""
    t = type(c)
    if t is KVCache:
        return ("plain",)
    if t is QuantizedKVCache:
        return ("quantized", c.bits, c.group_size)
    if t is RotatingKVCache:  # BatchRotatingKVCache keeps no "keep" prefix: only keep=0 merges
        return ("rotating", c.max_size) if c.keep == 0 else None
    if t is ArraysCache:
        return ("arrays", len(c.cache))
    if t is CacheList:
        inner = tuple(layer_kind(x) for x in c.caches)
        return None if None in inner else ("list", inner)
    return None


def merge_layer(caches: list):
    """One layer's caches (one per sequence, all of one `layer_kind`) as that kind's batch form."""
    first = caches[0]
    if type(first) is CacheList:
        return CacheList(*(merge_layer([c.caches[i] for c in caches]) for i in range(len(first.caches))))
    merge = {KVCache: BatchKVCache.merge, QuantizedKVCache: BatchQuantizedKVCache.merge,
             RotatingKVCache: BatchRotatingKVCache.merge, ArraysCache: ArraysCache.merge}[type(first)]
    return merge(caches)


def _why_alone(s: Sequence, kind: tuple | None, batch_step) -> str:
    kinds = ", ".join(sorted({type(c).__name__ for c in s.cache}))
    if kind is not None:
        return f"its KV cache ({kinds}) is laid out unlike the batch's"
    if len(s.pending) != 1:
        return "its prompt's tail is fed whole"
    return (f"its KV cache ({kinds}) has a layer with no batch form here (KVCache, QuantizedKVCache, "
            f"RotatingKVCache without keep, ArraysCache and CacheLists of them merge)")


class Merged:
    """Sequences that decode through MLX in one forward: their caches merged, layer by
    layer, into each layer kind's batch form (`merge_layer`).

    Invariants:
    - `members[i]` is the sequence in row i of every layer's batch, or None for a free row.
    - A member's own cache list (`Sequence.cache`, which its session holds) is stale while
      it is a member; `release` extracts its row back into it.
    - Membership changes copy only who joins or leaves. A leaver's row is extracted and
      left free. A joiner is written into a free row where every layer's batch form can
      take it there (`write_row`), else merged alone and appended (`extend`).
    - Free rows still run in the forward (a dummy token, output unread; rows never see
      each other). Once they are as many as the members, they are dropped (`filter`)."""

    FREE_TOKEN = 0  # what a free row is fed: any valid id

    def __init__(self) -> None:
        self.members: list[Sequence | None] = []
        self.cache: list = []

    def step(self, lm: LoadedModel, seqs: list[Sequence]) -> mx.array:
        """One token for each of `seqs` (one pending token each); their logits, in `seqs`' order."""
        for i, m in enumerate(self.members):
            if m is not None and not any(m is s for s in seqs):
                self._leave(i)
        self._join([s for s in seqs if not any(s is m for m in self.members)])
        self._compact()
        tokens = mx.array([m.pending if m is not None else [self.FREE_TOKEN] for m in self.members])
        logits = lm.runner.forward(tokens, self.cache)[:, -1, :]
        order = [next(i for i, m in enumerate(self.members) if m is s) for s in seqs]
        return logits if order == list(range(len(self.members))) else logits[mx.array(order)]

    def release(self, seq: Sequence) -> None:
        """Hand `seq`'s state back to its own cache and free its row; the others stay merged."""
        for i, m in enumerate(self.members):
            if m is seq:
                self._leave(i)

    def release_all(self) -> None:
        for i, s in enumerate(self.members):
            if s is not None:
                s.cache[:] = [c.extract(i) for c in self.cache]  # in place: the session holds this list
        self.members, self.cache = [], []

    def _leave(self, row: int) -> None:
        seq = self.members[row]
        seq.cache[:] = [c.extract(row) for c in self.cache]
        # Copy the row out now: while the lazy copy still reads the batch's buffers, the next
        # step's in-place write into them would copy them whole instead (5x a step at 8 x 4K).
        mx.eval([a for _, a in tree_flatten([c.state for c in seq.cache]) if isinstance(a, mx.array)])
        self.members[row] = None
        if all(m is None for m in self.members):
            self.members, self.cache = [], []

    def _join(self, joining: list[Sequence]) -> None:
        if not self.members:
            if joining:
                self.cache = [merge_layer([s.cache[i] for s in joining]) for i in range(len(joining[0].cache))]
                self.members = list(joining)
            return
        rest = []
        for s in joining:
            free = next((i for i, m in enumerate(self.members) if m is None), None)
            if free is not None and all(fits(b, c) for b, c in zip(self.cache, s.cache)):
                for b, c in zip(self.cache, s.cache):
                    write_row(b, free, c)
                self.members[free] = s
                log.debug("a sequence joins the batch in free row %d", free)
            else:
                rest.append(s)
        if rest:
            self._drop_free()  # one copy for both: the free rows go as the new ones come
            batch = [merge_layer([s.cache[i] for s in rest]) for i in range(len(rest[0].cache))]
            for mine, theirs in zip(self.cache, batch):
                mine.extend(theirs)
            self.members += rest

    def _compact(self) -> None:
        free = sum(m is None for m in self.members)
        if free and free >= len(self.members) - free:
            self._drop_free()

    def _drop_free(self) -> None:
        kept = [i for i, m in enumerate(self.members) if m is not None]
        if len(kept) == len(self.members):
            return
        keep = mx.array(kept, dtype=mx.int32)
        for c in self.cache:
            c.filter(keep)
        self.members = [self.members[i] for i in kept]


def _take(s: Sequence, logits: mx.array, failed: dict[Sequence, Exception]) -> None:
    try:
        s.take(logits)
    except Exception as exc:  # a grammar, a detokenizer, a client's callback: this sequence's alone
        failed[s] = exc


def _take_token(s: Sequence, token: int | Exception, failed: dict[Sequence, Exception], row: mx.array) -> None:
    if isinstance(token, Exception):
        failed[s] = token
        return
    try:
        s.take_token(token, row)
    except Exception as exc:  # a detokenizer, a client's callback: this sequence's alone
        failed[s] = exc


def generate(lm: LoadedModel, params: GenerationParams, emit: Callable[[GenerationEvent], None],
             cancelled: Callable[[], bool] = lambda: False, cache: list | None = None,
             sampled: list[int] | None = None, whole: Callable[[], bool] = lambda: False,
             drafting: Drafting | None = None) -> Finished:
    """One reply on its own, through the same steps the worker's batch takes: prefill
    `params.prompt` after its cached part into `cache` (a new one if None), then decode.
    Benchmarks, tests and tools use it; the server's requests go through the worker."""
    seq = Sequence(lm, params, make_prompt_cache(lm.model) if cache is None else cache, emit, whole=whole,
                   sampled=[] if sampled is None else sampled, drafting=drafting)
    batch = Batch(lm)
    while seq.phase is not Phase.DONE:
        if cancelled():
            return seq.cancel()
        if seq.phase is Phase.PREFILL:
            seq.prefill_chunk(params.prefill_step)
        elif seq in (failed := batch.step([seq])):
            raise failed[seq]
    return seq.result
