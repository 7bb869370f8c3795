"""The wire APIs a response can be asked for on. A run's route picks its events' framing
and what its reply may hold (/v1 seals reasoning on request, Chat trims at its stop
sequences, Anthropic's Messages always seals its thinking); the worker's log line names it."""

from typing import Literal

Route = Literal["lmsp", "v1", "chat", "completions", "messages"]
