"""Token log probabilities: one sampled token's entry, the ledger that keeps entries with
the text they wrote, and the shapes each wire API gives them in.

Which distribution: the model's own, as vLLM returns by default: the log-softmax of the
raw logits, before temperature, top_p/top_k, penalties, logit_bias or a grammar's mask.
So a logprob says what the model thinks of a token, whatever the request's sampling did
with it, and the same text gets the same figures at any temperature.

Invariant (`LogprobLedger`): the entries a stream hands out, in order, list every token
whose text reached the client once, and their `token` texts joined are exactly the text
the client was shown. A token only part of which is shown (the rest was markup, reasoning
or past a stop sequence) carries the part shown.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token: `token` its text, `logprob` its log probability, and `top` the
    likeliest tokens at its step (text, logprob), likeliest first (as many as asked)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    prompt: bool = False  # a prompt token (text completions' echo); the first has no logprob (nan)


class LogprobLedger:
    """Entries laid end to end over the text their tokens wrote, and handed out as spans of
    that text are shown: `shown(a, b)` says the characters [a, b) reached the client and
    returns the entries that are done by then (each once, with the part of its text that
    was shown); `rest()` at the end gives those partly shown and not yet handed out."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, TokenLogprob, str]] = []  # (start, entry, its text shown so far)
        self._end = 0  # where the next entry's text starts

    def add(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> None:
        for e in entries:
            self._pending.append((self._end, e, ""))
            self._end += len(e.token)

    def shown(self, a: int, b: int) -> tuple[TokenLogprob, ...]:
        out: list[TokenLogprob] = []
        keep: list[tuple[int, TokenLogprob, str]] = []
        for start, e, seen in self._pending:
            end = start + len(e.token)
            if start >= b:
                keep.append((start, e, seen))
                continue
            lo, hi = max(start, a), min(end, b)
            if hi > lo:
                seen += e.token[lo - start:hi - start]
            if end > b:  # more of it may yet be shown
                keep.append((start, e, seen))
            elif seen or (start == end and a <= start < b):
                out.append(replace(e, token=seen))
        self._pending = keep
        return tuple(out)

    def rest(self) -> tuple[TokenLogprob, ...]:
        out = tuple(replace(e, token=seen) for _, e, seen in self._pending if seen)
        self._pending = []
        return out


def _top(e: TokenLogprob) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top]


def openai_entries(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` and Responses' `output_text` `logprobs`."""
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()), "top_logprobs": _top(e)}
            for e in entries]


def _by_text(top: tuple[tuple[str, float], ...]) -> dict[str, float]:
    """Alternatives keyed by text: where two tokens share one (bytes of an unfinished
    character both read "\ufffd"), the likelier is kept."""
    out: dict[str, float] = {}
    for text, lp in top:
        out.setdefault(text, lp)
    return out


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Text completions' `logprobs` object (vLLM's and OpenAI's legacy shape): a prompt's
    first token has null where it has no logprob; `text_offset` is where each token starts
    in the choice's text, from `offset` on."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        first = e.prompt and e.logprob != e.logprob  # nan: nothing came before it
        logprobs.append(None if first else e.logprob)
        tops.append(None if first else _by_text(e.top))
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
