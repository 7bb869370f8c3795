"""Constrained decoding: the sampled tokens must follow a grammar (llguidance).

llguidance (Microsoft's Rust engine behind Guidance) compiles Lark grammars, with JSON
Schema embedded as `%json {...}`, and computes the set of allowed next tokens per step
in tens of microseconds; writing that engine here would be a project of its own. Its MLX
helper is a Metal kernel, so the mask is applied with `mx.where` on every backend.

A `Constraint` is per request and stateful: the worker applies it to the first token's
logits itself and hands it to mlx-lm's `generate_step` as a logits processor for the rest.
"""

from __future__ import annotations

import json
import threading

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

_tokenizers: dict[int, llguidance.LLTokenizer] = {}
_lock = threading.Lock()


class GrammarError(ValueError):
    """A grammar or schema the engine cannot compile; the message says why and where."""


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (built once: about a second for 50k tokens)."""
    with _lock:
        key = id(tokenizer)
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(getattr(tokenizer, "_tokenizer", tokenizer))
        return _tokenizers[key]


def lark_literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lark string literal


class Constraint:
    def __init__(self, tokenizer, grammar: str) -> None:
        """`grammar`: Lark text, or llguidance's JSON form with several grammars."""
        self.grammar = grammar  # what another rank builds the same constraint from (engine/lockstep.py)
        try:
            self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar)
        except Exception as exc:
            raise GrammarError(str(exc)) from None
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.vocab = ll_tokenizer(tokenizer).vocab_size
        self._bits = allocate_token_bitmask(1, self.vocab)
        # generate_step's token list starts with the token the worker sampled (and fed to
        # this constraint) last: the processor consumes what comes after it.
        self._seen = 1
        self.consumed = 0  # reply tokens the matcher has seen, in order

    def apply(self, logits: mx.array) -> mx.array:
        """Logits with every token the grammar forbids at this point set to -inf."""
        fill_next_token_bitmask(self.matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)
        size = logits.shape[-1]
        if size > self.vocab:  # embedding rows beyond the tokenizer (padding) are never allowed
            allowed = np.concatenate([allowed, np.zeros(size - self.vocab, dtype=bool)])
        return mx.where(mx.array(allowed[:size]), logits, -mx.inf)

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)
        self.consumed += 1

    def complete_after(self, reply: list[int]) -> bool:
        """Whether the grammar closed with the whole `reply`: nothing may follow. (mlx-lm's
        generate_step feeds each token to the processor before yielding it, so the matcher
        has normally seen them all; any it has not are consumed here.) A matcher in error
        is stopped too, but its reply is not complete."""
        for token in reply[self.consumed:]:
            self.consume(token)
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm's logits-processor form: `tokens` are those fed so far in generate_step."""
        ids = tokens.tolist()
        for t in ids[self._seen:]:
            self.consume(t)
        self._seen = len(ids)
        return self.apply(logits)
