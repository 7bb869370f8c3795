"""What a reply is generated with: its settings (`GenerationParams`, `Penalties`), and the
pieces a sequence uses around the model's runner: prefill of a prompt in chunks, and a
detokenizer set to continue a prompt's text."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from .loader import LoadedModel

log = logging.getLogger("lmsp_mlx.engine")

LONG_PREFILL = 1024  # prompts at least this long log their prefill progress


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
        were checked against the vocabulary in lmsp_mlx/service/run.py)."""
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
    top_k: int = 0  # sample among the k likeliest tokens; 0 keeps them all
    reasoning_budget: int | None = None  # the think block closes after this many tokens (Anthropic's budget_tokens)
    prefill_step: int = 256  # tokens per prompt chunk (--prefill-chunk): at most this delays the batch per step
    cached: int = 0  # leading prompt tokens already in the cache passed to generate()
    constraint: Any = None  # constrain.Constraint: a grammar the output must follow
    one_call: bool = False  # parallel_tool_calls false: the turn ends with its first tool call
    stop: tuple[str, ...] = ()  # Chat's stop sequences: the turn ends on the token that completes one
    penalties: Penalties | None = None
    seed: int | None = None  # sampling repeats for the same seed, prompt and settings
    raw: bool = False  # a text completion: the sampled text as it is, no reasoning or calls read out of it
    ignore_eos: bool = False  # vLLM's: the end of turn is sampled like any token (benchmarks' fixed lengths)
    speculate: bool = True  # False: this request drafts nothing, whatever --speculate says (a request's extension)
    logprobs: int | None = None  # each reply token's logprob and this many likeliest alternatives; None: none
    prompt_logprobs: bool = False  # the prompt's own token logprobs too (text completions' echo)


def prefill(lm: LoadedModel, tokens: list[int], cache: list, step: int, check: Callable[[int, int], None]) -> None:
    """Run `tokens` into `cache` in chunks of `step`, through the model's runner (the body
    only: mlx-lm's generate_step computes the output head for every prompt token and
    discards the logits; for SmolLM2 that head is a fifth of all prefill FLOPs).
    `check(done, total)` is called after each chunk."""
    total = len(tokens)
    for start in range(0, total, step):
        lm.runner.prefill(mx.array(tokens[start : start + step])[None], cache)
        mx.eval([c.state for c in cache])
        check(min(start + step, total), total)


def continue_after(detokenizer, token: int) -> None:
    """Make `detokenizer` read a continuation of text that ended with `token`: mlx-lm's drop
    the leading space of a reply's first word (right for a chat turn, wrong for a text
    completion: " Paris" would come back "Paris"). The token's own text is not the reply's."""
    detokenizer.add_token(token)
    if isinstance(detokenizer, (BPEStreamingDetokenizer, SPMStreamingDetokenizer)):
        detokenizer.finalize()  # a held-back space or partial character is the prompt's
    detokenizer.last_segment
