"""Stop sequences (Chat's and text completions' `stop`): the engine ends the turn on the
token that completes one, so usage is the same every time; the text is cut here, and text
that could be the start of one is held back until it is not, so a stream never shows a
stop sequence's first characters. Token logprobs are cut with the text: a token that
wrote the stop sequence is listed with the part of its text before it, and no token after."""

from __future__ import annotations

from ..protocol.logprobs import LogprobLedger, TokenLogprob


class StopScanner:
    """Cuts text at the first of `stops`, holding back a tail that may begin one.
    `logprobs`: the entries of the text the last `feed` or `flush` returned."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.held = ""
        self.matched: str | None = None  # the stop sequence reached (the first in the text)
        self.logprobs: tuple[TokenLogprob, ...] = ()
        self._ledger = LogprobLedger()
        self._shown = 0  # characters returned so far

    def feed(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> tuple[str, bool]:
        """The text that is safe to show, and whether a stop sequence was reached."""
        self._ledger.add(logprobs)
        text, self.held = self.held + text, ""
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return self._show(text[:at], end=True), True
        partial = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        if partial:  # the text may end in the start of a stop sequence: held until the next piece
            text, self.held = text[:-partial], text[-partial:]
        return self._show(text), False

    def flush(self) -> str:
        """At the end of a message, what was held back is text after all."""
        text, self.held = self.held, ""
        return self._show(text, end=True)

    def _show(self, text: str, end: bool = False) -> str:
        self.logprobs = self._ledger.shown(self._shown, self._shown + len(text))
        self._shown += len(text)
        if end:
            self.logprobs += self._ledger.rest()
        return text
