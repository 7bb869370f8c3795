"""One turn between the sampled text and the protocol: reasoning, text and tool calls out,
and what the turn leaves behind for the next one (remembered calls, visible transcript)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable

from ..cache.calls import CallMemory, CallTurn
from ..protocol.auth import LOCAL_OWNER
from ..cache.session import Binding
from ..protocol.ids import new_id
from ..protocol.problems import Problem
from ..protocol.requests import FunctionCallItem, FunctionTool, InputItem, MessageItem, ReasoningItem
from .events import GenerationEvent, ReasoningDelta, ReasoningEnd, TextDelta, ToolCall
from .output import OutputFormat, OutputParser, ParsedCall
from .render import (
    Prompt,
    continuation_text,
    continued_binding,
    encode,
    history_text,
    prompt_text,
    reveal,
    to_chat_messages,
    turn_binding,
    with_template_args,
)
from .tools import tool_specs

log = logging.getLogger("lmsp_mlx.engine")


@dataclass
class Conversation:
    """What a job carries besides token ids: enough to render the turn as a replay.

    `head`: the rendered text of a compacted conversation these items continue (a
    compaction item stood for it); the items are then rendered as its continuation, and
    its instructions and tools are already in it."""

    items: list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] = field(default_factory=list)  # offered to the model; none: calls not parsed
    native_tools: bool = False
    live_calls: tuple[str, ...] = ()  # a tool-output-only request: the live calls it continues
    head: str = ""
    callable: tuple[str, ...] | None = None  # the tools the reply may call, by name; None: all of `tools`
    owner: str = LOCAL_OWNER  # the token that sent it (lmsp_mlx/http/auth.py): who may continue its calls by call id
    template_args: dict = field(default_factory=dict)  # the chat template's own settings (render.Templated)

    def messages(self, memory: CallMemory | None, more: list[InputItem] = (), hidden: list[str] | None = None) -> list[dict]:
        return to_chat_messages(
            self.items + list(more), None if self.head else self.instructions, tools=[] if self.head else self.tools,
            native_tools=self.native_tools, memory=memory, hidden=hidden, allow_empty=bool(self.head),
        )

    def template_tools(self) -> list[dict] | None:
        return tool_specs(self.tools) if self.tools and self.native_tools and not self.head else None

    def prompt(self, tokenizer, memory: CallMemory | None) -> tuple[Prompt, str | None]:
        """The prompt, and the visible-only text where the prompt reveals sealed hidden
        reasoning (the true history: what the KV held)."""
        visible, true = self._texts(tokenizer, memory, history=False)
        if visible is None:
            raise Problem("invalid_request", "the model's chat template cannot continue the compacted conversation")
        return encode(tokenizer, true or visible), (visible if true else None)

    def history(self, tokenizer, memory: CallMemory | None) -> str | None:
        """The conversation's text up to where its next turn starts, hidden reasoning
        revealed: the part of the KV a compaction keeps."""
        visible, true = self._texts(tokenizer, memory, history=True)
        return true or visible

    def _texts(self, tokenizer, memory: CallMemory | None, history: bool) -> tuple[str | None, str | None]:
        tokenizer = with_template_args(tokenizer, self.template_args)

        def text(messages: list[dict]) -> str | None:
            if self.head:
                rest = continuation_text(tokenizer, messages, history=history)
                return None if rest is None else self.head + rest
            if history:
                return history_text(tokenizer, messages, self.template_tools())
            return prompt_text(tokenizer, messages, self.template_tools())

        hidden: list[str] = []
        revealed = self.messages(memory, hidden=hidden)
        visible = text(self.messages(memory))
        if not hidden:
            return visible, None
        marked = text(revealed)
        true = reveal(marked, hidden) if marked is not None else None
        if true is None:
            log.warning("this chat template does not keep a turn's content where hidden reasoning goes; "
                        "the visible history is rendered")
        return visible, true


class TurnOutput:
    """Feeds the sampled text through the parser and re-emits protocol-level events."""

    def __init__(self, tokenizer, conv: Conversation, prompt_text: str, emit: Callable[[GenerationEvent], None],
                 sampled: list[int] | None = None, one_call: bool = False, stop: tuple[str, ...] = (),
                 raw: bool = False):
        """`sampled`: the reply's tokens as they are sampled, to count the reasoning's.
        `one_call` (parallel_tool_calls false): calls after the first are not the reply's
        (formats that parse calls only at the turn's end, or several from one block).
        `stop`: Chat's stop sequences; `stopped` once the reply's text holds one.
        `raw`: a text completion, all of it text (think tags and call markup included)."""
        fmt = OutputFormat.of(tokenizer)
        if raw:
            fmt = replace(fmt, think=None)
        tools = {t.name: t for t in conv.tools if conv.callable is None or t.name in conv.callable} or None
        opens = fmt.opens_in_reasoning(prompt_text)
        self.parser = OutputParser(fmt, tools, state="reasoning" if opens else "text")
        # The opening tag the template put in the prompt belongs to the turn's raw reasoning.
        self._opening = prompt_text[prompt_text.rfind(fmt.think[0]):] if opens else ""
        self.tokenizer = tokenizer
        self.conv = conv
        self._emit = emit
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self._sampled = sampled if sampled is not None else []
        self.one_call = one_call
        self._skipped = False
        self.stop = stop
        self.stopped = False
        self._tail = ""  # the reply's last characters, enough to hold any stop sequence
        self._reasoning_end: int | None = None  # tokens sampled when the think block closed

    def feed(self, piece: str, logprobs: tuple = ()) -> None:
        self._send(self.parser.feed(piece, logprobs))

    def finish(self, cut: bool = False) -> None:
        """`cut`: the token limit ended the turn (OutputParser.finish)."""
        self._send(self.parser.finish(cut))

    def _send(self, events: list) -> None:
        for e in events:
            if isinstance(e, ParsedCall) and self.one_call and self.calls:
                log.info("parallel_tool_calls is false: a further call (%s) is not part of the reply", e.name)
                self._skipped = True
                continue
            if isinstance(e, ParsedCall):
                e = ToolCall(id=new_id("ctc" if e.custom else "fc"), call_id=new_id("call"), name=e.name,
                             arguments=e.arguments, custom=e.custom)
                self.calls.append(e)
            elif isinstance(e, ReasoningDelta):
                self.reasoning.append(e.text)
            elif isinstance(e, ReasoningEnd):
                e = ReasoningEnd(self._opening + e.raw)
                self._reasoning_end = len(self._sampled)
            elif isinstance(e, TextDelta):
                self.text.append(e.text)
                if self.stop and not self.stopped:
                    self._tail = (self._tail + e.text)[-(max(map(len, self.stop)) + len(e.text)):]
                    self.stopped = any(s in self._tail for s in self.stop)
            self._emit(e)

    @property
    def dropped(self) -> bool:
        """Sampled text is missing from the reply (a cut call, a call past the first, text
        from a stop sequence on): the KV holds more than a client can replay."""
        return self.parser.dropped or self._skipped or self.stopped

    def reasoning_tokens(self, output_tokens: int) -> int:
        """How many of the reply's tokens were reasoning: those sampled until its closing tag
        was read (the tag's own included; a detokenizer may read it a token late), or all of
        them when the turn ended inside the think block."""
        if self._reasoning_end is not None:
            return min(self._reasoning_end, output_tokens)
        return output_tokens if self.reasoning and not self.text and not self.calls else 0

    def output_items(self) -> list[InputItem]:
        """This turn's output as a client replays it."""
        items: list[InputItem] = []
        if self.reasoning:
            items.append(ReasoningItem(type="reasoning", summary=[{"type": "summary_text", "text": "".join(self.reasoning)}]))
        text = "".join(self.text)
        if text.strip() or not self.calls:
            items.append(MessageItem(role="assistant", content=text))
        for c in self.calls:
            namespace, _, name = c.name.rpartition(".")
            items.append(FunctionCallItem(type="function_call", call_id=c.call_id, name=name,
                                          namespace=namespace or None, arguments=c.arguments, id=c.id, custom=c.custom))
        return items

    def remember(self, memory: CallMemory) -> CallTurn | None:
        """Keep the turn's sampled text for exact replay, by each of its call ids."""
        if not self.calls:
            return None
        items = tuple(i.model_dump(exclude_none=True) for i in self.conv.items + self.output_items())
        turn = CallTurn(tuple(c.call_id for c in self.calls), "".join(self.parser.visible), items, self.conv.head,
                        self.conv.owner)
        memory.remember(turn)
        return turn

    def binding(self, memory: CallMemory, ended: str) -> Binding | None:
        messages = self.conv.messages(memory, self.output_items())
        tokenizer = with_template_args(self.tokenizer, self.conv.template_args)
        if self.conv.head:
            return continued_binding(tokenizer, self.conv.head, messages, ended)
        return turn_binding(tokenizer, messages, ended, tools=self.conv.template_tools())
