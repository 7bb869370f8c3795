"""What the tests ask servers, and how they read the answers: request bodies, SSE parsing,
and where a request's KV came from (read off /metrics)."""

from __future__ import annotations

import json
import re

import httpx

from tests.tiny_model import ENDLESS

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"

# The tests' one HTTP client, shared: httpx.get/post build a client, and with it an SSL
# context that loads the whole CA bundle, on every call: about 0.1 s here, most of a tiny
# model's request. Its defaults are the module functions' (a 5 s timeout, no redirects).
# Connections are pooled per server; a stream closed before its end closes its connection,
# so a test that leaves a stream still disconnects from the server.
HTTP = httpx.Client(timeout=5.0)


def ask(text: str = ENDLESS, **fields) -> dict:
    """A /lmsp/v1/responses body for the tiny model: greedy, 8 tokens unless told."""
    body = {"model": "tiny", "input": text, "temperature": 0, "max_output_tokens": 8}
    body.update(fields)
    return body


def kv_lookups(server, headers: dict | None = None) -> dict[str, int]:
    """Where the server's requests found their KV so far, by cache source (/metrics), with
    "tool-output" counting the requests whose tool outputs alone continued live calls."""
    text = HTTP.get(server.url + "/metrics", headers=headers or {}, timeout=30).text
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r'^lmsp_kv_lookups_total\{source="(\w+)"\} (\d+)$',
                                                               text, re.M)}
    counts["tool-output"] = int(re.search(r"^lmsp_kv_live_continuations_total (\d+)$", text, re.M).group(1))
    return counts


def lookups_during(server, call) -> dict[str, int]:
    """The cache sources of the requests `call()` made (none other may run meanwhile)."""
    before = kv_lookups(server)
    call()
    after = kv_lookups(server)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def source_of(server, call, headers: dict | None = None):
    """`call()`'s result, with the cache source of the one request it made recorded on
    `server.sources` (none is where it failed before its lookup): a lookup kind, or
    "tool-output" where its tool outputs alone continued the live calls. `headers`: what
    /metrics needs (the admin scope) on a server with tokens."""
    result = None

    def run():
        nonlocal result
        result = call()

    before = kv_lookups(server, headers)
    run()
    after = kv_lookups(server, headers)
    found = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    if "tool-output" in found:
        found = {"tool-output": 1} if sum(found.values()) == 2 else found
    assert sum(found.values()) <= 1, f"one request, several lookups: {found}"
    server.sources.extend(found)
    return result


def read_sse(lines) -> list[dict]:
    """Parse an SSE stream into [{'id':..., 'event':..., 'data':...}] records."""
    events, current = [], {}
    for line in lines:
        if line == "":
            if current:
                events.append(current)
                current = {}
            continue
        if line.startswith(":"):  # a comment (the server's keep-alive): SSE clients ignore it
            continue
        field, _, value = line.partition(": ")
        if field == "data" and value != "[DONE]":
            value = json.loads(value)
        current[field] = value
    if current:
        events.append(current)
    return events
