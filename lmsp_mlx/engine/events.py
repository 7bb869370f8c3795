"""What the worker reports about one generation, in order: deltas and calls, then one ending."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from ..protocol.logprobs import TokenLogprob


@dataclass(frozen=True)
class TextDelta:
    """`logprobs`: where the request asked for them, the entries of the tokens this text
    finished (protocol/logprobs.py: their texts need not line up with this piece's)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's own token entries (a text completion's `echo` with `logprobs`), before
    the reply's first delta."""

    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ReasoningEnd:
    """The think block closed. `raw`: the turn's text through its closing tag exactly as the
    KV holds it (the opening tag included, from the prompt where the template opened it)."""

    raw: str


@dataclass(frozen=True)
class ToolCall:
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text; a custom tool's raw input
    custom: bool = False


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of output_tokens, those up to the end of the think block

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class Finished:
    """`stop`: the model ended its turn; `length`: max_output_tokens; `cancelled`: the client
    left; `complete`: the reply's grammar closed on the last token the limit allowed, so
    nothing could have followed but the end of the turn (which was not sampled)."""

    reason: Literal["stop", "length", "cancelled", "complete"]
    usage: Usage
    prefill_tps: float = 0.0
    decode_tps: float = 0.0


@dataclass(frozen=True)
class Failed:
    message: str
    code: str = "internal_error"  # a problem code (docs/api.md)


GenerationEvent = Union[TextDelta, PromptLogprobs, ReasoningDelta, ReasoningEnd, ToolCall, Finished, Failed]
