"""Log probabilities of sampled and prompt tokens (the distribution is stated in
protocol/logprobs.py: the model's raw logits, log-softmaxed).

Each token's own text comes from `TokenTexts`, not from the streaming detokenizer: that
one flushes a word only when the next begins, so its pieces do not line up with tokens.
`TokenTexts` decodes a short window of the last tokens, as vLLM's incremental detokenizer
does, and gives each token the text it added. Joined, the texts are the reply's text (the
first word's leading space dropped where the reply's detokenizer drops it), which is what
lets the protocol's ledger hand each token out with the text it wrote.
"""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..protocol.logprobs import Alternative, TokenLogprob, token_text
from .loader import LoadedModel

WINDOW = 6  # tokens decoded before the new one: enough for a character split over several byte tokens
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte fallback


@functools.lru_cache(maxsize=1)
def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what byte-level BPE vocabularies spell tokens in) back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def token_bytes(tokenizer, token: int) -> bytes | None:
    """A token's own bytes where its text alone is not whole characters (a byte-level or
    byte-fallback piece of a character); None where its text says it all."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return None
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        if m := _BYTE_TOKEN.match(piece):
            return bytes([int(m.group(1), 16)])
        table = _byte_level()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return None


def alternative(tokenizer, token: int, logprob: float) -> Alternative:
    raw = token_bytes(tokenizer, token)
    if raw is None:
        text = tokenizer.decode([token])
        return Alternative(text, logprob, text.encode())
    return Alternative(token_text(raw), logprob, raw)


class TokenTexts:
    """The text each token adds to those before it. `before`: tokens the text continues
    (the prompt's last, for a text completion), whose own text is not given out. `trim`:
    the reply's first text loses a leading space, as mlx-lm's detokenizers do for a chat
    turn. `skip`: tokens with no text (a text completion's special tokens)."""

    def __init__(self, tokenizer, before: list[int] = (), trim: bool = False, skip: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.tokens = list(before)
        self.read = len(self.tokens)  # tokens whose text has been given out
        self.trim = trim
        self.skip = skip

    def add(self, token: int) -> str | None:
        """The text `token` adds, or None while it ends inside a character (its text then
        comes with the token that finishes the character, or from `flush`)."""
        if token in self.skip:
            return ""
        self.tokens.append(token)
        return self._new(final=False)

    def flush(self) -> str:
        """At the reply's end: the text of tokens still unfinished, as the detokenizer's
        own end gives it (an unfinished character as U+FFFD)."""
        return self._new(final=True) or ""

    def _new(self, final: bool) -> str | None:
        start = max(0, self.read - WINDOW)
        known = self.tokenizer.decode(self.tokens[start:self.read])
        text = self.tokenizer.decode(self.tokens[start:])
        if not final and (len(text) <= len(known) or text.endswith("\ufffd")):
            return None
        new = text[len(known):]
        self.tokens = self.tokens[-WINDOW:]
        self.read = len(self.tokens)
        if self.trim and new:
            new, self.trim = (new[1:] if new.startswith(" ") else new), False
        return new


def entry(tokenizer, row: mx.array, token: int, text: str, top: int) -> TokenLogprob:
    """`token`'s entry from its step's raw logits `row` (1, vocab), with the `top` likeliest."""
    lp = row[0].astype(mx.float32)
    lp = lp - mx.logsumexp(lp)
    raw = token_bytes(tokenizer, token)
    if not top:
        return TokenLogprob(text, lp[token].item(), raw=raw)
    ids = mx.argpartition(-lp, top - 1)[:top]
    chosen, values = lp[token], lp[ids]
    mx.eval(chosen, ids, values)
    return TokenLogprob(text, chosen.item(), _ranked(tokenizer, ids.tolist(), values.tolist()), raw=raw)


def _ranked(tokenizer, ids: list[int], values: list[float]) -> tuple[Alternative, ...]:
    """The alternatives of one step, likeliest first."""
    return tuple(alternative(tokenizer, i, v) for i, v in sorted(zip(ids, values), key=lambda p: -p[1]))


def prompt_entries(lm: LoadedModel, tokens: list[int], top: int, chunk: int = 256) -> list[TokenLogprob]:
    """Every prompt token's entry, for text completions' `echo`: the log probability of each
    token after those before it (the first has none: nan), from a pass of its own over a
    cache of its own, so that it does not depend on what the KV pool held. Each chunk's
    rows are ranked together, with one sync."""
    texts = TokenTexts(lm.tokenizer, skip=lm.special_token_ids)
    out = [TokenLogprob(texts.add(tokens[0]) or "", float("nan"), prompt=True, raw=token_bytes(lm.tokenizer, tokens[0]))]
    cache = make_prompt_cache(lm.model)
    for start in range(0, len(tokens) - 1, chunk):
        logits = lm.runner.forward(mx.array([tokens[start:start + chunk]]), cache)[0].astype(mx.float32)
        targets = tokens[start + 1:start + chunk + 1]
        lp = logits[:len(targets)]
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, mx.array(targets)[:, None], axis=-1)[:, 0]
        ids = mx.argpartition(-lp, top - 1, axis=-1)[:, :top] if top else mx.zeros((len(targets), 0), mx.int32)
        values = mx.take_along_axis(lp, ids, axis=-1)
        mx.eval(chosen, ids, values)
        for t, c, row_ids, row_values in zip(targets, chosen.tolist(), ids.tolist(), values.tolist()):
            out.append(TokenLogprob(texts.add(t) or "", c, _ranked(lm.tokenizer, row_ids, row_values), prompt=True,
                                    raw=token_bytes(lm.tokenizer, t)))
    if rest := texts.flush():  # the prompt ends inside a character
        out[-1] = replace(out[-1], token=out[-1].token + rest)
    return out
