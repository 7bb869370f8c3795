"""Reading a request's body: JSON as RFC 8259 has it (no NaN, no lone surrogates), a
malformed one a 400 `invalid_request`."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from quart import request

from ..protocol.problems import Problem
from ..protocol.requests import ResponsesRequest, parse_request

log = logging.getLogger("lmsp_mlx.server")


async def read_json() -> Any:
    """The body as JSON; malformed JSON is 400 `invalid_request`."""
    try:
        raw = await request.get_data()
        # A client that closes right after sending its request is cancelled as its last
        # bytes arrive, and Python 3.11's asyncio.wait_for (inside get_data) may return the
        # body and drop the cancellation: the generation would run for nobody. It is
        # still counted on the task.
        if (task := asyncio.current_task()) is not None and task.cancelling():
            raise asyncio.CancelledError
    except asyncio.CancelledError:
        log.info("request %s %s status=499 (the client closed the connection with its request)",
                 request.method, request.path)
        raise
    return decode_json(raw, "the body")


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259)")  # Python's json reads NaN and Infinity


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_json(raw: str | bytes, what: str) -> Any:
    """`raw` as JSON (a body, a WebSocket message); malformed is 400 `invalid_request`, and
    so is a string holding half of a UTF-16 surrogate pair (JSON allows the escape, but it
    is no text: the tokenizer and the store could not take it)."""
    try:
        value = json.loads(raw, parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Problem("invalid_request", f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise Problem("invalid_request", f"{what} nests JSON too deeply") from None
    if _SURROGATE_ESCAPE.search(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")):
        try:  # only escapes can make one; paired ones are fine
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise Problem("invalid_request", f"{what} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                          "without its pair), which is not text") from None
    return value


async def read_request() -> ResponsesRequest:
    """The body as a validated request."""
    return parse_request(await read_json())
