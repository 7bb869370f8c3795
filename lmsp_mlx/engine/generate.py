"""The hot loop: prefill the prompt, decode tokens, stream text pieces out.

The prompt is prefilled here in chunks (cancellation is checked between them) and the
first token sampled here; mlx-lm's `generate_step` then decodes with async evaluation. Around it: end-of-turn
detection, UTF-8-safe text pieces and timings.
"""

from __future__ import annotations

import functools
import logging
from contextlib import closing
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from .events import Finished, GenerationEvent, TextDelta, Usage
from .loader import LoadedModel

log = logging.getLogger("lmsp_mlx.engine")

LONG_PREFILL = 1024  # prompts at least this long log their prefill progress


class Cancelled(Exception):
    """The client went away; raised between prefill chunks or decode steps."""

    def __init__(self, prefilled: int = 0, produced: int = 0, prefill_tps: float = 0.0, decode_tps: float = 0.0) -> None:
        super().__init__(f"cancelled after {prefilled} prompt and {produced} output tokens")
        self.prefilled = prefilled
        self.produced = produced
        self.prefill_tps = prefill_tps  # the rates until then, for the request's log line
        self.decode_tps = decode_tps


@dataclass(frozen=True)
class Penalties:
    """What OpenAI's sampling settings add to the logits: `bias` per token id (logit_bias),
    and presence and frequency penalties, by which a token's logit falls once the reply
    holds it and for each time it does."""

    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()

    def apply(self, reply: mx.array, logits: mx.array) -> mx.array:
        shift = self._bias(logits.shape[-1])
        if self.presence or self.frequency:
            counts = mx.zeros_like(shift).at[reply].add(1.0)
            shift = shift - self.frequency * counts - self.presence * (counts > 0)
        return logits + shift.astype(logits.dtype)

    @functools.lru_cache(maxsize=4)
    def _bias(self, width: int) -> mx.array:
        """The logit_bias shift over the vocabulary, built once per reply, not per step (ids
        were checked against the vocabulary in server/run.py)."""
        shift = mx.zeros((width,), dtype=mx.float32)
        if self.bias:
            ids, values = zip(*self.bias)
            shift = shift.at[mx.array(ids)].add(mx.array(values))
        return shift


@dataclass
class GenerationParams:
    prompt: list[int]  # everything the KV holds before decoding, the cached part included
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    prefill_step: int = 256
    cached: int = 0  # leading prompt tokens already in the cache passed to generate()
    constraint: Any = None  # constrain.Constraint: a grammar the output must follow
    one_call: bool = False  # parallel_tool_calls false: the turn ends with its first tool call
    stop: tuple[str, ...] = ()  # Chat's stop sequences: the turn ends on the token that completes one
    penalties: Penalties | None = None
    seed: int | None = None  # sampling repeats for the same seed, prompt and settings
    raw: bool = False  # a text completion: the sampled text as it is, no reasoning or calls read out of it
    ignore_eos: bool = False  # vLLM's: the end of turn is sampled like any token (benchmarks' fixed lengths)


def prefill(lm: LoadedModel, tokens: list[int], cache: list, step: int, check: Callable[[int, int], None]) -> None:
    """Run `tokens` into `cache` in chunks through the model's body only.

    mlx-lm's generate_step computes the output head for every prompt token and discards
    the logits; for SmolLM2 that head is a fifth of all prefill FLOPs. The body of an
    mlx-lm model is its `model` attribute; models without one go through whole."""
    body = getattr(lm.model, "model", None)
    run = body if isinstance(body, nn.Module) else lm.model
    total = len(tokens)
    for start in range(0, total, step):
        run(mx.array(tokens[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
        check(min(start + step, total), total)


class _LastRow(nn.Module):
    """A model body that hands the output head only its last position.

    The pass that samples the first token runs the prompt's tail (up to 64 rows) through
    the whole model; the head is position-wise, so computing it for the one row that is
    sampled gives the same logits. For SmolLM2 the skipped rows were 20-25% of that pass
    (a 49k-row matmul per row), the time an agent waits for its first token."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def __call__(self, *args, **kwargs):
        out = self.body(*args, **kwargs)
        return out[:, -1:] if isinstance(out, mx.array) and out.ndim == 3 else out

    def __getattr__(self, key: str):
        if key == "body":
            return super().__getattr__(key)
        return getattr(self.body, key)  # e.g. tied heads use model.embed_tokens


def last_logits(lm: LoadedModel, tokens: list[int], cache: list) -> mx.array:
    """Logits (1, vocab) after running `tokens` into `cache`, the head computed for the last
    token only. mlx-lm models keep their body in `model`; others go through whole."""
    outer = lm.model
    body = outer.get("model") if isinstance(outer, nn.Module) else None
    if len(tokens) == 1 or not isinstance(body, nn.Module):
        return outer(mx.array([tokens]), cache=cache)[:, -1, :]
    outer.model = _LastRow(body)
    try:
        return outer(mx.array([tokens]), cache=cache)[:, -1, :]
    finally:
        outer.model = body


def continue_after(detokenizer, token: int) -> None:
    """Make `detokenizer` read a continuation of text that ended with `token`: mlx-lm's drop
    the leading space of a reply's first word (right for a chat turn, wrong for a text
    completion: " Paris" would come back "Paris"). The token's own text is not the reply's."""
    detokenizer.add_token(token)
    if isinstance(detokenizer, (BPEStreamingDetokenizer, SPMStreamingDetokenizer)):
        detokenizer.finalize()  # a held-back space or partial character is the prompt's
    detokenizer.last_segment


def sample_tokens(lm: LoadedModel, tail: list[int], cache: list, sampler, max_tokens: int, constraint=None,
                  penalties: Penalties | None = None, seed: int | None = None) -> Iterator[int]:
    """Tokens after the prefilled cache, starting with the prompt's unprefilled `tail`.

    The first two are sampled synchronously: generate_step computes a step ahead before it
    yields, so its first token came after two decode steps (measured: +87 ms on the CPU)
    and its second after about 1.7. A reasoning reply's first visible event (its first
    reasoning text) needs the second token. The rest come from generate_step's pipelined
    loop."""
    key = None
    if seed is not None:  # the worker samples one reply at a time: the global key is this reply's alone
        key = mx.random.state[0].tolist()  # as it was: mx.random.key(s) is [s >> 32, s & 0xffffffff]
        mx.random.seed(seed % 2**64)
    try:
        inputs, reply = tail, []
        while len(reply) < min(max_tokens, 2):
            logits = last_logits(lm, inputs, cache)
            if constraint is not None:
                logits = constraint.apply(logits)
            if penalties is not None:
                logits = penalties.apply(mx.array(reply, dtype=mx.int32), logits)
            sampled = sampler(logits - mx.logsumexp(logits, keepdims=True))
            token = sampled.item()
            if constraint is not None:
                constraint.consume(token)
            reply.append(token)
            inputs = [token]
            yield token
        if max_tokens > len(reply):
            processors = [constraint] if constraint is not None else []
            if penalties is not None:  # generate_step's tokens start at its input, the last token above
                head = mx.array(reply[:-1], dtype=mx.int32)
                processors.append(lambda tokens, logits: penalties.apply(mx.concatenate([head, tokens]), logits))
            for t, _ in generate_step(mx.array([token]), lm.model, prompt_cache=cache, sampler=sampler,
                                      max_tokens=max_tokens - len(reply), logits_processors=processors or None):
                yield t
    finally:
        if key is not None:  # unseeded replies after it stay unpredictable (the state is not assignable)
            mx.random.seed(key[0] << 32 | key[1])


def generate(
    lm: LoadedModel,
    params: GenerationParams,
    emit: Callable[[GenerationEvent], None],
    cancelled: Callable[[], bool],
    cache: list | None = None,
    sampled: list[int] | None = None,
    whole: Callable[[], bool] = lambda: False,
) -> Finished:
    """Prefill `params.prompt` after its cached part into `cache` (a new one if None), then
    decode. Every sampled token, end-of-turn included, is appended to `sampled`. `whole()`
    says, after a token's text was emitted, that the reply needs nothing more (its one
    call is made): the turn then ends `complete`."""
    sampled = [] if sampled is None else sampled

    def check(done: int, total: int) -> None:
        if cancelled():
            raise Cancelled(prefilled=params.cached + done, prefill_tps=done / max(perf_counter() - start, 1e-9))
        if total >= LONG_PREFILL and 0 < done < total:
            log.info("prefill %d/%d tokens", done, total)

    start = perf_counter()
    cache = make_prompt_cache(lm.model) if cache is None else cache
    if params.max_tokens == 0:  # a prewarm (generate: false): the whole prompt into the KV, nothing sampled
        prefill(lm, params.prompt[params.cached:], cache, params.prefill_step, check)
        n = len(params.prompt)
        return Finished(reason="stop", usage=Usage(input_tokens=n, output_tokens=0, cached_tokens=params.cached),
                        prefill_tps=(n - params.cached) / max(perf_counter() - start, 1e-9))
    # The last prefill chunk (up to 64 tokens) goes through the whole model, in the pass
    # that also gives the first token's logits: an agent's short suffix takes one pass. With
    # the CPU's compiled decode step a longer prompt leaves only its last token for that
    # pass: a one-token step (25-40 ms) is cheaper than a 64-row pass, which runs at a
    # fraction of a full chunk's matmul rate (512-token prompts: 5-12% faster).
    new = len(params.prompt) - params.cached
    tail = max(1, min(new % params.prefill_step or params.prefill_step, new, 64))
    if new > 64 and hasattr(lm.model, "decode_step"):
        tail = 1
    prefill(lm, params.prompt[params.cached : -tail], cache, params.prefill_step, check)
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p if params.top_p < 1 else 0.0)
    detokenizer = lm.tokenizer.detokenizer
    skip: frozenset[int] = frozenset()  # tokens with no text in the reply
    if params.raw:
        continue_after(detokenizer, params.prompt[-1])
        skip = lm.special_token_ids  # as vLLM's skip_special_tokens
    first = None
    reason = "length"
    produced = 0
    reply: list[int] = []
    tokens = sample_tokens(lm, params.prompt[-tail:], cache, sampler, params.max_tokens, params.constraint,
                           params.penalties, params.seed)
    with closing(tokens):  # a seeded reply gives the random key back before anything else samples
        for token in tokens:
            sampled.append(token)
            reply.append(token)
            if first is None:
                first = perf_counter()
            if token in lm.eos_token_ids and not params.ignore_eos:
                reason = "stop"
                break
            produced += 1
            if token not in skip:
                detokenizer.add_token(token)
            if piece := detokenizer.last_segment:
                emit(TextDelta(piece))
            if cancelled():
                now = perf_counter()
                raise Cancelled(prefilled=len(params.prompt), produced=produced,
                                prefill_tps=(len(params.prompt) - params.cached) / max(first - start, 1e-9),
                                decode_tps=(produced - 1) / (now - first) if produced > 1 and now > first else 0.0)
            if whole():
                reason = "complete"
                break
    detokenizer.finalize()
    if piece := detokenizer.last_segment:
        emit(TextDelta(piece))
    if reason == "length" and params.constraint is not None and params.constraint.complete_after(reply):
        reason = "complete"  # a call or JSON value that closed on the limit's last token is whole
    end = perf_counter()
    first = first or end
    prompt_len = len(params.prompt)
    return Finished(
        reason=reason,
        usage=Usage(input_tokens=prompt_len, output_tokens=produced, cached_tokens=params.cached),
        prefill_tps=(prompt_len - params.cached) / max(first - start, 1e-9),
        decode_tps=(produced - 1) / (end - first) if produced > 1 and end > first else 0.0,
    )
