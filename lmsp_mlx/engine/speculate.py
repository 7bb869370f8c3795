"""Speculative decoding by prompt lookup: a sequence drafts the tokens that followed the
last time its own recent tokens appeared, and one step verifies them.

A decode step reads every weight once, so one sequence cannot decode faster than
weights ÷ bandwidth. Verifying k drafted tokens is one step with k more rows, which on a
memory-bound step costs far less than k steps; every drafted token the model agrees with
is a step saved. Agent replies quote their context (a file rewritten with one change, JSON
echoed back, a tool's arguments re-sent), so the sequence's own prompt and reply are a
good drafter, and one that needs no second model.

The pieces:
- `PromptLookup` (--speculate ngram): it indexes every n-gram (n = 2..4) of the
  sequence's tokens by where it last ended, and drafts what followed the longest n-gram
  that ends the sequence now, up to k tokens.
- `DraftModel` (--speculate draft, --draft-model): a smaller model with the target's
  tokenizer drafts k tokens greedily, on a KV cache of its own that follows the sequence.
- `Drafting`: one sequence's speculation state: the drafter, how many tokens it drafts now
  (k adapts to what is accepted) and its pause after drafts that were refused, so that
  text where lookup does not help costs almost nothing.
- `rollback_plan` / `rewind`: how a sequence's cache gives back the rows of refused draft
  tokens: `trim` for plain, quantized and rotating caches (a rotating one while its window
  has room), and for recurrent layers (`ArraysCache`) their state before the draft put
  back and the accepted tokens run again.

Verification itself is `Sequence.take_drafted` (engine/sequence.py): the step's logits
for each fed row are sampled in turn with the sequence's own sampler, exactly as decoding
without speculation would sample them, and the run stops at the first token that differs
from the draft. The tokens a reply gets are therefore the tokens it gets without
speculation: the same greedy tokens, the same seeded draws. For an unseeded draw this is
speculative sampling with a draft distribution that is all on the drafted token: the draft
is kept with probability p(draft) = min(1, p/q) for q = 1, and otherwise the token comes
from p without it, the normalised residual. Both drafters draft that way (the draft
model greedily), so one verifier serves them and the output distribution is the model's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal, Protocol

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..cache.pool import common_prefix
from .generate import prefill

log = logging.getLogger("lmsp_mlx.engine")

NGRAM_SIZES = (4, 3, 2)  # the longest match first; a single token matches too much at random
PAUSE_AFTER_MISSES = 2  # refused drafts in a row before the sequence pauses drafting
LONGEST_PAUSE = 64  # steps
DRAFT_PREFILL_CHUNK = 512  # tokens the draft model takes in one pass when it catches up with a prompt
DRAFT_ONE_PASS = 16  # fewer new tokens than this go through the draft model in one pass, head included


class Drafter(Protocol):
    """What drafts a sequence's next tokens: up to `k` of them after `tokens` (its prompt and
    reply so far), or [] for no guess. `PromptLookup` is the one --speculate ngram uses."""

    def draft(self, tokens: list[int], k: int) -> list[int]: ...


class PromptLookup:
    """Drafts from the sequence's own tokens: what followed the latest earlier occurrence of
    the longest n-gram (NGRAM_SIZES) that ends them. The index grows with the tokens, each
    position indexed once, so a draft costs a few dictionary lookups however long the
    prompt."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # positions < this are in `_last` as n-gram ends

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest recent match of `tokens`' end; [] for none."""
        end = len(tokens)
        # Index each n-gram that ends before the last token: its continuation is known.
        for e in range(max(self._indexed, 1), end):
            for n in NGRAM_SIZES:
                if e >= n:
                    self._last[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end)
        for n in NGRAM_SIZES:
            if end >= n and (at := self._last.get(tuple(tokens[end - n :]))) is not None:
                return tokens[at : at + k]
        return []


class DraftModel:
    """Drafts with a second, smaller model that shares the target's tokenizer: k tokens,
    each its argmax (a draft distribution all on one token, which `Sequence.take_drafted`
    verifies exactly). One per sequence: it owns a KV cache of the draft model that follows
    the sequence's tokens.

    Invariant: `_fed` are the tokens the cache holds, in order. Before a draft the cache
    keeps the longest prefix it shares with the sequence (the refused draft tokens are
    trimmed away) and takes the rest: the accepted tokens and the target's own next one,
    or, at the first draft, the whole prompt in chunks. A draft model whose cache cannot be
    trimmed (recurrent layers) starts over from the prompt after a refused draft."""

    def __init__(self, draft) -> None:
        self.lm = draft  # engine.loader.LoadedModel
        self.cache = make_prompt_cache(draft.model)
        self._fed: list[int] = []

    def draft(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or not tokens:
            return []
        keep = common_prefix(self._fed, tokens[:-1])  # the last token is fed again: its logits draft
        if keep < len(self._fed):
            if can_trim_prompt_cache(self.cache):
                trim_prompt_cache(self.cache, len(self._fed) - keep)
            else:
                self.cache, keep = make_prompt_cache(self.lm.model), 0
            del self._fed[keep:]
        logits = self._feed(tokens[keep:])
        out: list[int] = []
        while True:
            out.append(int(mx.argmax(logits).item()))
            if len(out) == k:
                return out
            logits = self._feed(out[-1:])

    def _feed(self, tokens: list[int]) -> mx.array:
        """Run `tokens` through the draft model's cache; the logits after the last one."""
        # A few tokens (what a step accepted) take one pass; a prompt runs body-only in
        # chunks, and only its last token through the output head.
        head = tokens[:-1] if len(tokens) > DRAFT_ONE_PASS else []
        prefill(self.lm, head, self.cache, DRAFT_PREFILL_CHUNK, lambda done, total: None)
        logits = self.lm.runner.forward(mx.array([tokens[len(head):]]), self.cache)[0, -1]
        self._fed.extend(tokens)
        return logits


def same_tokenizer(target, draft) -> str | None:
    """None where `draft` (a LoadedModel) can draft for `target`: the same vocabulary, token
    for id; else the first difference, in words."""
    a, b = target.tokenizer.vocab, draft.tokenizer.vocab
    if a == b:
        return None
    if len(a) != len(b):
        return f"its vocabulary has {len(b)} tokens, the model's {len(a)}"
    differ = next(t for t in a if b.get(t) != a[t])
    return f"token {differ!r} is id {a[differ]} in the model and {b.get(differ)} in the draft model"


@dataclass
class Drafting:
    """One sequence's speculation: its drafter, the draft length in use and its pause.

    Invariants: 1 <= k <= max_draft; while `paused` > 0 the sequence drafts nothing, one
    step less each step; `drafted` >= `accepted`."""

    max_draft: int
    drafter: Drafter = field(default_factory=PromptLookup)
    k: int = 0
    paused: int = 0
    misses: int = 0
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.k = self.max_draft

    def draft(self, tokens: list[int], room: int) -> list[int]:
        """This step's draft for a sequence whose tokens are `tokens`, at most `room` long
        (what the reply and its cache have left)."""
        if self.paused:
            self.paused -= 1
            return []
        return self.drafter.draft(tokens, min(self.k, room))

    def settle(self, drafted: int, accepted: int) -> None:
        """After a verified draft: k grows by one when all of it was accepted, falls to what
        was accepted plus one otherwise; a run of refused drafts pauses drafting, longer each
        time (2, 4, ... LONGEST_PAUSE steps)."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k = min(self.max_draft, self.k + 1)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= PAUSE_AFTER_MISSES:
            self.paused = min(LONGEST_PAUSE, 2 ** (self.misses - 1))

    def summary(self) -> str:
        return f"{self.accepted}/{self.drafted} drafted tokens accepted" if self.drafted else "nothing drafted"


RollbackKind = Literal["trim", "rerun"]


def rollback_plan(cache: list, rows: int) -> RollbackKind | None:
    """How `cache` gives back refused rows after `rows` are fed: "trim" where every layer
    trims; "rerun" where some layer must be put back to its state before the step (`snapshot`)
    and the accepted tokens run again: recurrent layers (`ArraysCache`), whose state has no
    rows, and rotating ones whose window the step fills (a trim there would leave the next
    write on the wrong slot); None where a layer is of a kind neither applies to."""
    kinds = {_layer_rollback(c, rows) for c in cache}
    if None in kinds:
        return None
    return "rerun" if "rerun" in kinds else "trim"


def _layer_rollback(c, rows: int) -> RollbackKind | None:
    t = type(c)
    if t in (KVCache, QuantizedKVCache):
        return "trim"
    if t is RotatingKVCache:
        return "trim" if c.offset + rows <= c.max_size else "rerun"
    if t is ArraysCache:
        return "rerun"
    if t is CacheList:
        inner = {_layer_rollback(x, rows) for x in c.caches}
        return None if None in inner else "rerun" if "rerun" in inner else "trim"
    return None


def snapshot(cache: list) -> list:
    """What `rewind` puts back, layer by layer: an ArraysCache's arrays, a RotatingKVCache's
    buffers and positions (None for layers that trim). Holding the arrays is enough: a step
    of several rows replaces them (models assign new state arrays; a rotating cache
    concatenates) and never writes into the ones held."""
    return [_layer_snapshot(c) for c in cache]


def _layer_snapshot(c):
    t = type(c)
    if t is ArraysCache:
        return list(c.cache)
    if t is RotatingKVCache:
        return (c.keys, c.values, c.offset, c._idx)
    if t is CacheList:
        return [_layer_snapshot(x) for x in c.caches]
    return None


def rewind(cache: list, rows: int, saved: list | None) -> None:
    """Undo the last `rows` rows of a step: each layer with a `snapshot` goes back to it,
    the others trim."""
    for i, c in enumerate(cache):
        _rewind_layer(c, rows, None if saved is None else saved[i])


def _rewind_layer(c, rows: int, saved) -> None:
    t = type(c)
    if t is CacheList:
        for i, x in enumerate(c.caches):
            _rewind_layer(x, rows, None if saved is None else saved[i])
    elif t is ArraysCache:
        c.cache = list(saved)
    elif t is RotatingKVCache and saved is not None:
        c.keys, c.values, c.offset, c._idx = saved
    else:
        c.trim(rows)
