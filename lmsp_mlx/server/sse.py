"""Server-Sent Events framing: LMSP's (integer `id:`, section 6.3) and Open Responses' (/v1)."""

from __future__ import annotations

import json
from typing import Any

from quart import Response

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events) -> Response:
    """An event stream that proxies must not buffer."""
    return Response(events, mimetype="text/event-stream", headers=SSE_HEADERS)


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class LmspEvents:
    """Numbers one response's events from 1; every data object also carries `type` and
    `sequence_number` (= the id), as PROTOCOL.md fixes, for generic Responses clients."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.last_id = 0

    def __call__(self, name: str, **fields: Any) -> str:
        self.last_id += 1
        data = {"type": name, "sequence_number": self.last_id, "response_id": self.response_id, **fields}
        return f"id: {self.last_id}\nevent: {name}\ndata: {_json(data)}\n\n"


class OpenResponsesEvents:
    """Open Responses framing: `event:` equals the data's `type`; ends with `data: [DONE]`."""

    DONE = "data: [DONE]\n\n"

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, name: str, **fields: Any) -> str:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {name}\ndata: {_json(data)}\n\n"
