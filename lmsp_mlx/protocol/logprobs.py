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
class Alternative:
    """One of the likeliest tokens at a step: its text (a token that is part of a character
    reads `bytes:\\xf0\\x9f`, as OpenAI writes such tokens) and its own bytes."""

    token: str
    logprob: float
    bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token: `token` the text it wrote, `logprob` its log probability, `top` the
    likeliest tokens at its step, likeliest first (as many as asked). `raw`: its own bytes
    where they are not its text's (a character split over several tokens: the bytes of a
    reply's tokens, joined, are its text's bytes, as OpenAI's `bytes` are)."""

    token: str
    logprob: float
    top: tuple[Alternative, ...] = ()
    prompt: bool = False  # a prompt token (text completions' echo); the first has no logprob (nan)
    raw: bytes | None = None

    @property
    def bytes(self) -> bytes:
        return self.token.encode() if self.raw is None else self.raw


def token_text(raw: bytes) -> str:
    """A token's text for a list of alternatives: its bytes as text where they are whole
    characters, else OpenAI's `bytes:\\x..` form."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


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
                out.append(_shown(e, seen))
        self._pending = keep
        return tuple(out)

    def rest(self) -> tuple[TokenLogprob, ...]:
        out = tuple(_shown(e, seen) for _, e, seen in self._pending if seen)
        self._pending = []
        return out


def _shown(e: TokenLogprob, seen: str) -> TokenLogprob:
    """`e` with the part of its text that was shown (its bytes then that part's)."""
    return e if seen == e.token else replace(e, token=seen, raw=None)


def _top(e: TokenLogprob) -> list[dict[str, Any]]:
    return [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in e.top]


def openai_entries(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` and Responses' `output_text` `logprobs`."""
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes), "top_logprobs": _top(e)}
            for e in entries]


def _by_text(top: tuple[Alternative, ...]) -> dict[str, float]:
    """Alternatives keyed by text: where two tokens share one, the likelier is kept."""
    out: dict[str, float] = {}
    for a in top:
        out.setdefault(a.token, a.logprob)
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
