"""One reply being generated, as the batch sees it: its own KV cache, its own sampling.

A `Sequence` moves through two phases. In `PREFILL` its prompt goes into its cache in
chunks the worker hands out one at a time, so a long prompt never holds the others for
more than a chunk; its tail then either gives the first token in one pass, or (the CPU's
compiled step) is the last prompt token, left for the first decode step. In `DECODE` it
waits for the next batched step to feed its pending token and give back its logits row;
`take` samples from that row with the sequence's own settings and turns the token into
text. It is `DONE` once it holds its `Finished`.

Invariants: the cache holds `prompt[:cursor]` in PREFILL and `prompt + reply[:-1]` in
DECODE (the last sampled token is fed by the next step, so a reply that ends leaves it
unfed: the session pool accounts for that), less the prompt's tail while `pending` holds it. Nothing here knows about other sequences:
the batch (engine/batch.py) only calls `prefill_chunk`, reads `pending` and calls `take`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field, replace
from time import perf_counter
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from .events import Finished, GenerationEvent, PromptLogprobs, TextDelta, Usage
from .generate import LONG_PREFILL, GenerationParams, continue_after, prefill
from .logprobs import TokenTexts, entry, prompt_entries
from .loader import LoadedModel
from .speculate import Drafting

log = logging.getLogger("lmsp_mlx.engine")

# A suffix this short goes into the cache as rows of the batched decode step, not as a
# prefill chunk: prefill's matmuls run at a fraction of their rate on a few rows. Measured
# (SmolLM2 float32 on an 1,800-token session, benchmarks/agent_loop.py --suffix-turns):
# 8 new tokens took 161 ms as a prefill and a step, 81 as rows; from ~24 prefill wins.
SHORT_SUFFIX = 16


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class ReasoningBudget:
    """Closes the think block once it holds `budget` tokens: its closing tokens are then
    forced, one a step, as if sampled (Anthropic's thinking.budget_tokens). The block is
    tracked by the tokenizer's marker ids, from the prompt's end on (a template may open it)."""

    def __init__(self, budget: int, start: tuple[int, ...], end: tuple[int, ...], prompt: list[int]) -> None:
        self.budget, self.start, self.end = budget, start, end
        self.thinking = _last(prompt, start) > _last(prompt, end)
        self.spent = 0
        self.forcing: list[int] = []
        self.tail: list[int] = []  # the last tokens, enough to hold either marker

    def forced(self) -> int | None:
        """The token this step must give, if the budget is spent."""
        if self.thinking and not self.forcing and self.spent >= self.budget:
            self.forcing = list(self.end)
        return self.forcing.pop(0) if self.forcing else None

    def saw(self, token: int) -> None:
        """After each token the reply takes."""
        self.tail = [*self.tail, token][-max(len(self.start), len(self.end)):]
        if tuple(self.tail[-len(self.start):]) == self.start:
            self.thinking, self.spent = True, 0
        elif self.thinking:
            self.spent += 1
            if tuple(self.tail[-len(self.end):]) == self.end:
                self.thinking, self.forcing = False, []


def _last(tokens: list[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `tokens`, or -1."""
    n = len(marker)
    return next((i for i in range(len(tokens) - n, -1, -1) if tuple(tokens[i:i + n]) == marker), -1)


@dataclass(frozen=True)
class Draw:
    """How a token is drawn from adjusted logits: greedy at temperature 0."""

    temperature: float
    top_p: float
    top_k: int


def draw(logits: mx.array, how: Draw, key: mx.array | None = None) -> list[int]:
    """One token per row of `logits` (rows, vocab), all drawn as `how` says, with one sync."""
    if how.temperature == 0:
        return mx.argmax(logits, axis=-1).tolist()
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < how.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, how.top_k)
    if how.top_p < 1:
        logprobs = apply_top_p(logprobs, how.top_p)
    return mx.random.categorical(logprobs * (1.0 / how.temperature), key=key).tolist()


def sample_rows(seqs: list["Sequence"], logits: mx.array) -> list[int | Exception]:
    """Each sequence's next token from its row of `logits` (len(seqs), vocab): the rows of
    one draw setting go through one `draw` (one sync for all, not one a sequence); a seeded
    sequence draws alone from its own key chain. A row whose adjustment or draw raises
    gets its exception; the others their tokens."""
    out: list[int | Exception | None] = [None] * len(seqs)
    groups: dict[Draw, list[tuple[int, mx.array]]] = {}
    for i, s in enumerate(seqs):
        try:
            if (token := s.sampler.forced()) is not None:
                out[i] = token
                continue
            row = s.sampler.adjusted(logits[i : i + 1], s.reply)
            if s.sampler.shared:
                groups.setdefault(s.sampler.settings, []).append((i, row))
            else:
                out[i] = draw(row, s.sampler.settings, s.sampler.next_key())[0]
        except Exception as exc:  # a grammar's mask, a bad bias: this sequence's alone
            out[i] = exc
    for how, rows in groups.items():
        try:
            tokens = draw(mx.concatenate([r for _, r in rows]), how)
        except Exception:  # retried row by row, so that only a failing row fails
            tokens = []
            for _, r in rows:
                try:
                    tokens.append(draw(r, how)[0])
                except Exception as exc:
                    tokens.append(exc)
        for (i, _), token in zip(rows, tokens):
            out[i] = token
    for i, s in enumerate(seqs):
        if isinstance(out[i], int):
            try:
                s.sampler.taken(out[i])
            except Exception as exc:
                out[i] = exc
    return out


def reasoning_budget(params: GenerationParams, tokenizer) -> ReasoningBudget | None:
    """The budget of a request that sets one, for a tokenizer whose think markers are known."""
    start, end = getattr(tokenizer, "think_start_tokens", None), getattr(tokenizer, "think_end_tokens", None)
    if params.reasoning_budget is None or not start or not end:
        return None
    # Only the prompt's tail can hold the open block's marker that matters; scanning a long
    # prompt whole would cost each request a pass over every token.
    return ReasoningBudget(params.reasoning_budget, tuple(start), tuple(end), params.prompt[-4096:])


class Sampler:
    """A sequence's own sampling: grammar mask, penalties and logit_bias, temperature, top_k
    and top_p, and with a `seed` its own random key chain, so a seeded reply gives the same
    tokens whatever runs beside it and leaves the global random state alone."""

    def __init__(self, params: GenerationParams, budget: ReasoningBudget | None = None) -> None:
        self.budget = budget
        self.temperature = params.temperature
        self.top_p = params.top_p
        self.top_k = params.top_k
        self.constraint = params.constraint
        self.penalties = params.penalties
        self._key = mx.random.key(params.seed % 2**64) if params.seed is not None else None

    def __call__(self, logits: mx.array, reply: list[int]) -> int:
        """The next token after `reply`, from this step's logits (1, vocab)."""
        if (token := self.forced()) is not None:
            return self.taken(token)
        [token] = draw(self.adjusted(logits, reply), self.settings, self.next_key())
        return self.taken(token)

    @property
    def settings(self) -> Draw:
        return Draw(self.temperature, self.top_p, self.top_k)

    @property
    def shared(self) -> bool:
        """Whether its draw may share one call with other rows of the same settings: no seed
        (a seeded sequence draws from its own key chain)."""
        return self._key is None

    def greedy_rows(self, logits: mx.array) -> list[int] | None:
        """Every row's token at once, where each is the row's argmax whatever came before it:
        greedy with no grammar, penalty, bias or reasoning budget (those depend on the tokens
        taken before); None otherwise."""
        if self.temperature != 0 or self.constraint is not None or self.penalties is not None \
                or self.budget is not None:
            return None
        return mx.argmax(logits, axis=-1).tolist()

    def forced(self) -> int | None:
        """The token the reasoning budget forces this step, if any (no logits needed)."""
        return self.budget.forced() if self.budget is not None else None

    def adjusted(self, logits: mx.array, reply: list[int]) -> mx.array:
        """The logits (1, vocab) after the grammar mask, the penalties and logit_bias (lazy)."""
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        if self.penalties is not None:
            logits = self.penalties.apply(mx.array(reply, dtype=mx.int32), logits)
        return logits

    def next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key

    def taken(self, token: int) -> int:
        """Record `token` as drawn (the grammar and the reasoning budget advance); returns it."""
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.budget is not None:
            self.budget.saw(token)
        return token


@dataclass(eq=False)  # compared by identity: the batch finds it in its lists
class Sequence:
    """`emit` gets each text piece; `whole()` says, after a piece, that the reply needs
    nothing more (its one call is made): it then ends `complete`. `sampled` collects every
    sampled token, end-of-turn included."""

    lm: LoadedModel
    params: GenerationParams
    cache: list
    emit: Callable[[GenerationEvent], None]
    whole: Callable[[], bool] = lambda: False
    sampled: list[int] = field(default_factory=list)
    phase: Phase = Phase.PREFILL
    result: Finished | None = None
    pending: list[int] = field(default_factory=list)  # the tokens the next decode step feeds
    alone: str | None = None  # why this sequence steps outside the batched forward (logged once)
    together: bool = True  # its prompt may prefill in one forward with others' (engine/batch.py `prefill_group`)
    drafting: Drafting | None = None  # its speculation (engine/speculate.py); None: it never drafts

    def __post_init__(self) -> None:
        p = self.params
        self.cursor = p.cached  # prompt tokens in the cache
        # The prompt's tail that gives the first token's logits. With the CPU's compiled
        # batched step, a suffix of up to SHORT_SUFFIX tokens is all tail: its rows ride in
        # the next decode step (one pass, beside the other sequences' tokens, the weights
        # read once); a longer prompt leaves its last token for it. Otherwise the tail (up
        # to 64 tokens) runs through the whole model in one pass, the head computed for its
        # last row only. Either way an agent's short suffix takes one pass, not a prefill
        # and a step.
        new = len(p.prompt) - p.cached
        if self.lm.runner.batch is not None:
            self.tail = new if new <= SHORT_SUFFIX else 1
            self.rows = True  # the tail is fed by the decode step
        else:
            self.tail = max(1, min(new % p.prefill_step or p.prefill_step, new, 64))
            self.rows = self.tail == 1
        self.sampler = Sampler(p, reasoning_budget(p, self.lm.tokenizer))
        self.detokenizer = self.lm.tokenizer.detokenizer
        self.skip: frozenset[int] = frozenset()  # tokens with no text in the reply
        if p.raw:
            continue_after(self.detokenizer, p.prompt[-1])
            self.skip = self.lm.special_token_ids  # as vLLM's skip_special_tokens
        self.texts: TokenTexts | None = None  # each token's own text, where logprobs are asked for
        self.unfinished: list = []  # entries of tokens that end inside a character, not yet sent
        if p.logprobs is not None:
            trims = isinstance(self.detokenizer, BPEStreamingDetokenizer) or \
                isinstance(self.detokenizer, SPMStreamingDetokenizer) and self.detokenizer.trim_space
            self.texts = TokenTexts(self.lm.tokenizer, before=p.prompt[-1:] if p.raw else [],
                                    trim=trims and not p.raw, skip=self.skip)
            if p.prompt_logprobs:  # scored in a pass of its own, before anything is sampled
                self.emit(PromptLogprobs(tuple(prompt_entries(self.lm, p.prompt, p.logprobs))))
        self.reply: list[int] = []
        self.produced = 0
        self.began = perf_counter()
        self.first: float | None = None
        if self.to_prefill == 0 and self.rows:
            self._prefilled()

    # -- prefill ----------------------------------------------------------------------------

    @property
    def to_prefill(self) -> int:
        """Prompt tokens still to go into the cache before the first decode step."""
        end = len(self.params.prompt) - (self.tail if self.params.max_tokens > 0 else 0)
        return max(0, end - self.cursor)

    def prefill_chunk(self, size: int) -> None:
        """Run the next `size` prompt tokens into the cache; then the tail: a pass that
        samples the first token, or the last prompt token left for the first decode step."""
        p = self.params
        n = min(size, self.to_prefill)
        if n:
            prefill(self.lm, p.prompt[self.cursor : self.cursor + n], self.cache, n, lambda done, total: None)
        self.cursor += n
        total = len(p.prompt) - p.cached
        if total >= LONG_PREFILL and self.to_prefill:
            log.info("prefill %d/%d tokens", self.cursor - p.cached, total)
        if self.to_prefill == 0:
            self._prefilled()

    def _prefilled(self) -> None:
        p = self.params
        if p.max_tokens == 0:  # a prewarm (generate: false): the whole prompt into the KV, nothing sampled
            return self._end("stop")
        self.phase = Phase.DECODE
        if self.rows:
            self.pending = p.prompt[-self.tail:]
            self.cursor = len(p.prompt) - self.tail
        else:
            logits = self.lm.runner.last_logits(p.prompt[-self.tail:], self.cache)
            self.cursor = len(p.prompt)
            self.take(logits)

    def prefilled_but_last(self) -> None:
        """Its prompt is in the cache but for the last token (a batched prefill ran the rest):
        that token is fed by the next decode step, which gives the first token's logits."""
        self.cursor = len(self.params.prompt) - 1
        self.pending = self.params.prompt[-1:]
        self.phase = Phase.DECODE

    # -- decode -----------------------------------------------------------------------------

    def take(self, logits: mx.array) -> None:
        """Sample from the logits (1, vocab) the step gave after `pending`, and stream the token."""
        self.take_token(self.sampler(logits, self.reply), logits)

    def draft(self, most: int) -> list[int]:
        """The tokens (at most `most`) this decode step may verify after `pending`: a draft
        where the sequence speculates and has one token pending; [] otherwise."""
        if self.drafting is None or len(self.pending) != 1:
            return []
        room = min(most, self.params.max_tokens - len(self.reply) - 1)  # the step gives one token more than it drafts
        if room < 1:
            return []
        return self.drafting.draft(self.params.prompt + self.reply, room)

    def take_drafted(self, logits: mx.array, draft: list[int]) -> int:
        """Take the tokens a verifying step gives: `logits` (1 + len(draft), vocab) are the
        rows after `pending` and after each drafted token. Each row is sampled in turn, as
        `take` samples a step's row, and the run stops at the first token that is not the
        draft's (or where the reply ends). Returns how many of the fed rows the cache keeps:
        those whose tokens are now the reply's, `pending` and the accepted drafted tokens."""
        taken = accepted = 0
        greedy = self.sampler.greedy_rows(logits)  # one sync for every row, where that draws the same
        for j in range(len(draft) + 1):
            if greedy is None:
                self.take(logits[j : j + 1])  # a token the budget forces is taken as in any step
            else:
                self.take_token(self.sampler.taken(greedy[j]), logits[j : j + 1])
            taken += 1
            hit = j < len(draft) and self.reply[-1] == draft[j]
            accepted += hit
            if self.phase is Phase.DONE or not hit:
                break
        self.drafting.settle(len(draft), accepted)
        return taken

    def take_token(self, token: int, row: mx.array | None = None) -> None:
        """Stream `token`, drawn by `sample_rows` or `take` (already recorded by the sampler)
        from `row`, its step's raw logits (1, vocab), which give its logprob where asked."""
        p = self.params
        self.sampled.append(token)
        self.reply.append(token)
        if self.first is None:
            self.first = perf_counter()
        if token in self.lm.eos_token_ids and not p.ignore_eos:
            return self._end("stop")
        self.produced += 1
        if token not in self.skip:
            self.detokenizer.add_token(token)
        piece = self.detokenizer.last_segment
        if self.texts is not None and row is not None:  # every token, so that the ledger sees each one's text
            text = self.texts.add(token)
            self.unfinished.append(entry(self.lm.tokenizer, row, token, text or "", p.logprobs))
            if text is not None:  # the tokens of a split character go out with the one that ends it
                self.emit(TextDelta(piece, tuple(self.unfinished)))
                self.unfinished = []
            elif piece:
                self.emit(TextDelta(piece))
        elif piece:
            self.emit(TextDelta(piece))
        if self.whole():
            return self._end("complete")
        if len(self.reply) >= p.max_tokens:
            return self._end("length")
        self.pending = [token]

    def cancel(self) -> Finished:
        """End now, as the client left: the usage and rates so far."""
        self.result = Finished("cancelled", self._usage(), *self._rates())
        self.phase = Phase.DONE
        return self.result

    @property
    def prefilled(self) -> int:
        return len(self.params.prompt) if self.phase is Phase.DECODE else self.cursor

    def _end(self, reason: str) -> None:
        p = self.params
        if p.max_tokens > 0:
            self.detokenizer.finalize()
            held = ()
            if self.unfinished:  # the reply ended inside a character: the last of them carries its text
                last = self.unfinished[-1]
                held = (*self.unfinished[:-1], replace(last, token=self.texts.flush()))
                self.unfinished = []
            if (piece := self.detokenizer.last_segment) or held:
                self.emit(TextDelta(piece, held))
        if reason == "length" and p.constraint is not None and p.constraint.complete_after(self.reply):
            reason = "complete"  # a call or JSON value that closed on the limit's last token is whole
        self.cursor = len(p.prompt)
        self.result = Finished(reason, self._usage(), *self._rates())
        self.phase = Phase.DONE

    def _usage(self) -> Usage:
        return Usage(input_tokens=len(self.params.prompt), output_tokens=self.produced, cached_tokens=self.params.cached)

    def _rates(self) -> tuple[float, float]:
        """(prefill, decode) tokens per second: the prompt until the first token, then the reply."""
        now = perf_counter()
        first = self.first or now
        new = (self.prefilled if self.first is None else len(self.params.prompt)) - self.params.cached
        decode = (self.produced - 1) / (now - first) if self.produced > 1 and now > first else 0.0
        return new / max(first - self.began, 1e-9), decode
