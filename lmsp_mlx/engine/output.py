"""The model's streamed text, split into reasoning, visible text and tool calls.

Markers come from the tokenizer where mlx-lm knows them (`think_start`/`think_end`,
`tool_call_start`/`tool_call_end` and the model's own `tool_parser`); models without
them use `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format the
project's tool prompt asks for (see `tools.py`). Text that could be the start of a marker
is held back until the next piece decides. A call that does not parse, or names a
function the request did not offer, stays visible text and is logged: never a 500, never
an invented call.

Token logprobs ride along: the parser keeps the characters it has consumed (`_at`), so
each visible piece knows where it lies in the sampled text, and a `LogprobLedger` hands
out the entries of the tokens that wrote it (reasoning and call markup hand out none).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from mlx_lm.tool_parsers import json_tools

from ..protocol.logprobs import LogprobLedger
from .events import ReasoningDelta, ReasoningEnd, TextDelta
from .tools import tool_specs

log = logging.getLogger("lmsp_mlx.engine")

DEFAULT_CALL = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text; a custom tool's raw input
    custom: bool = False


@dataclass(frozen=True)
class OutputFormat:
    think: tuple[str, str] | None
    call: tuple[str, str]
    parse: Callable[[str, Any], Any]

    @classmethod
    def of(cls, tokenizer) -> "OutputFormat":
        think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else None
        if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_call_start:
            end = tokenizer.tool_call_end or ""
            return cls(think, (tokenizer.tool_call_start, end), tokenizer.tool_parser)
        return cls(think, DEFAULT_CALL, json_tools.parse_tool_call)

    def opens_in_reasoning(self, prompt_text: str) -> bool:
        """Templates that open the think block in the generation prompt (it ends with the
        opening tag) start the reply inside the reasoning."""
        return self.think is not None and prompt_text.rstrip().endswith(self.think[0])


@dataclass
class OutputParser:
    fmt: OutputFormat
    tools: dict[str, Any] | None  # name -> tool; None: calls are not parsed (tool_choice none)
    state: str = "text"  # text | reasoning | call
    visible: list[str] = field(default_factory=list)  # everything outside reasoning, markup included
    _buf: str = ""
    _fed: list[str] = field(default_factory=list)  # every piece, for the raw reasoning text
    _cut: bool = False  # finish(cut=True): the token limit ended the turn
    dropped: bool = False  # the cut dropped sampled text: the KV holds more than the reply shows
    _at: int = 0  # characters fed before `_buf`
    _ledger: LogprobLedger = field(default_factory=LogprobLedger)

    def feed(self, piece: str, logprobs: tuple = ()) -> list:
        self._buf += piece
        self._fed.append(piece)
        self._ledger.add(logprobs)
        return self._drain(final=False)

    def finish(self, cut: bool = False) -> list:
        """The rest of the turn. `cut`: the token limit ended it, so a call it was writing
        (or a marker it had begun) is dropped: half a call is no reply, and its markup as
        text would be noise (the response is `incomplete` either way)."""
        self._cut = cut
        out = self._drain(final=True)
        if rest := self._ledger.rest():  # tokens part of whose text was shown before markup
            out.append(TextDelta("", rest))
        return out

    def _markers(self) -> list[str]:
        if self.state == "reasoning":
            return [self.fmt.think[1]]
        marks = [self.fmt.call[0]] if self.tools is not None else []
        return marks + ([self.fmt.think[0]] if self.fmt.think else [])

    def _drain(self, final: bool) -> list:
        out: list = []
        while True:
            if self.state == "call":
                close = self.fmt.call[1]
                end = _call_end(self._buf, close) if close else -1
                if end < 0 and final and close:  # a JSON body that never closed: its first marker, if any
                    end = self._buf.find(close)
                if end < 0:
                    if not final:
                        return out
                    if close and self._cut:
                        log.info("the token limit cut a tool call (%d characters); dropped from the reply", len(self._buf))
                        self._consume(len(self._buf))
                        self.dropped = True
                        return out
                    if close:  # the model ended its turn inside a call: it stays text
                        log.warning("tool call not closed before the turn ended; kept as text")
                        out.append(self._text(self.fmt.call[0] + self._buf, self._at - len(self.fmt.call[0])))
                        self._consume(len(self._buf))
                        return out
                    end = len(self._buf)  # formats without a closing marker end with the turn
                body = self._buf[:end]
                out += self._calls(body)
                self._consume(end + len(close))
                self.state = "text"
                continue
            hits = [(i, m) for m in self._markers() if (i := self._buf.find(m)) >= 0]
            if hits:
                i, marker = min(hits)
                out.append(self._piece(self._buf[:i]))
                self._consume(i + len(marker))
                if self.state == "reasoning":
                    self.state = "text"
                    if not self.visible:  # the turn opened with it: its raw text is a prefix of the turn
                        fed = "".join(self._fed)
                        out.append(ReasoningEnd(fed[: len(fed) - len(self._buf)]))
                elif marker == self.fmt.call[0] and self.tools is not None:
                    self.state = "call"
                else:
                    self.state = "reasoning"
                continue
            held = 0 if final else _held_back(self._buf, self._markers())
            if final and self._cut and self.state == "text" and self.tools is not None:
                # Cut while writing the call marker: dropped like the call it began.
                if begun := _held_back(self._buf, [self.fmt.call[0]]):
                    self._buf, self.dropped = self._buf[: len(self._buf) - begun], True
            out.append(self._piece(self._buf[: len(self._buf) - held]))
            self._consume(len(self._buf) - held)
            return [e for e in out if e is not None]

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._at += n

    def _piece(self, text: str):
        """`text`: the start of `_buf`."""
        if not text:
            return None
        return ReasoningDelta(text) if self.state == "reasoning" else self._text(text, self._at)

    def _text(self, text: str, at: int) -> TextDelta:
        """Visible `text`, which is the sampled text from `at` on."""
        self.visible.append(text)
        return TextDelta(text, self._ledger.shown(at, at + len(text)))

    def _calls(self, body: str) -> list:
        raw = self.fmt.call[0] + body + self.fmt.call[1]
        at = self._at - len(self.fmt.call[0])  # the call's text as sampled, its markers included
        if (custom := self._custom_call(body)) is not None:
            self.visible.append(raw)
            return [custom]
        try:
            parsed = self.fmt.parse(body, tool_specs(list(self.tools.values())))  # mlx-lm parsers take HF specs
            calls = parsed if isinstance(parsed, list) else [parsed]
            result = []
            for call in calls:
                name, args = call["name"], call.get("arguments", {})
                if name not in self.tools:
                    raise ValueError(f"the request offers no function {name!r}")
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(args, dict):
                    raise ValueError("arguments are not a JSON object")
                if self.tools[name].custom:  # a template that shows custom tools as functions of `input`
                    result.append(ParsedCall(name, str(args.get("input", "")), custom=True))
                else:
                    result.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        except Exception as exc:  # any malformed call is the model's text, not an error
            log.warning("malformed tool call kept as text: %s: %.200s", exc, body)
            return [self._text(raw, at)]
        self.visible.append(raw)
        return result

    def _custom_call(self, body: str) -> ParsedCall | None:
        """`\n{"name": "<custom tool>"}\n<raw input>\n`: a custom tool's call (tools.py)."""
        if self.fmt.call != DEFAULT_CALL or not self.tools or not any(t.custom for t in self.tools.values()):
            return None
        inner = body[1:] if body.startswith("\n") else body
        inner = inner[:-1] if inner.endswith("\n") else inner
        head, newline, rest = inner.partition("\n")
        try:
            name = json.loads(head).get("name")
        except (ValueError, AttributeError):
            return None
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None or not tool.custom or json.loads(head) != {"name": name}:
            return None
        return ParsedCall(name, rest if newline else "", custom=True)


def _call_end(buf: str, close: str) -> int:
    """Where a call's closing marker starts in `buf`, or -1 for not yet.

    A body that is a JSON object is read as JSON first: its strings may hold the marker's
    text (a grammar-valid argument can: one sampled reply put `}}</tool_call>` inside a
    city name), so the marker is looked for only after the object closes."""
    start = len(buf) - len(buf.lstrip())
    if buf[start:start + 1] == "{":
        start = _json_object_end(buf, start)
        if start < 0:
            return -1
    return buf.find(close, start)


def _json_object_end(text: str, i: int) -> int:
    """The index just past the JSON object opening at text[i], or -1 if it is not closed yet."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def _held_back(buf: str, markers: list[str]) -> int:
    """Length of the longest end of `buf` that could begin a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if m.startswith(buf[-k:]):
                best = max(best, k)
                break
    return best
