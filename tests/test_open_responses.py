"""Every /v1 object and event against the Open Responses specification's own types.

`openresponses-types` (mozilla.ai, Apache-2.0) is generated from the specification's
published OpenAPI document; its pydantic models check each required field, type and
nullability. Each streamed event is validated against the model for its `type`; an event
type the specification does not define fails the test."""

from __future__ import annotations

import json

import pytest
from tests.helpers import HTTP, read_sse
from tests.test_tools import QUESTION, TOOLS

types = pytest.importorskip("openresponses_types.types", reason="openresponses-types is a test dependency")


def _event_models() -> dict[str, type]:
    """Event type name -> its model, read off each *StreamingEvent model's `type` field."""
    out = {}
    for name in dir(types):
        cls = getattr(types, name)
        if isinstance(cls, type) and name.endswith("StreamingEvent") and "type" in getattr(cls, "model_fields", {}):
            annotation = cls.model_fields["type"].annotation
            values = [m.value for m in annotation] if isinstance(annotation, type) else list(getattr(annotation, "__args__", ()))
            for value in values:
                out[str(value)] = cls
    return out


EVENTS = _event_models()
FINAL = ("response.completed", "response.incomplete", "response.failed")


def check_stream(server, body: dict) -> list[dict]:
    with HTTP.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    events = [e for e in read_sse(lines) if isinstance(e.get("data"), dict)]
    for e in events:
        data = e["data"]
        assert e["event"] == data["type"]
        assert data["type"] in EVENTS, f"{data['type']} is not an Open Responses event"
        EVENTS[data["type"]].model_validate(data)
    names = [e["data"]["type"] for e in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] in FINAL
    assert [e["data"]["sequence_number"] for e in events] == list(range(len(events)))
    return [e["data"] for e in events]


def check_order(events: list[dict]) -> None:
    """Per item: added, (content part added, deltas, text done, part done), done."""
    open_items: dict[int, list[str]] = {}
    for e in events[2:-1]:
        i = e.get("output_index")
        open_items.setdefault(i, []).append(e["type"])
    for i, seq in open_items.items():
        assert seq[0] == "response.output_item.added" and seq[-1] == "response.output_item.done", seq
        if "response.content_part.added" in seq:
            assert seq.index("response.content_part.added") < seq.index("response.output_text.done") \
                < seq.index("response.content_part.done")


def test_text_streams_and_objects_follow_the_specification(tiny_server):
    body = {"model": "tiny", "input": "Count these tokens, the whole prompt", "temperature": 0, "max_output_tokens": 8}
    events = check_stream(tiny_server, body)
    check_order(events)
    sync = HTTP.post(tiny_server.url + "/v1/responses", json=body, timeout=120).json()
    types.ResponseResource.model_validate(sync)
    stored = HTTP.get(f"{tiny_server.url}/v1/responses/{sync['id']}").json()
    types.ResponseResource.model_validate(stored)


def test_the_echoed_tools_say_strict_as_the_schema_requires(tiny_server):
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    body = {"model": "tiny", "input": "Count", "temperature": 0, "max_output_tokens": 4, "tool_choice": "none"}
    for tools, strict in (([tool], None), ([{**tool, "strict": False}], False)):
        sync = HTTP.post(tiny_server.url + "/v1/responses", json={**body, "tools": tools}, timeout=120).json()
        assert sync["tools"][0]["strict"] is strict  # present, boolean or null
        types.ResponseResource.model_validate(sync)


def test_reasoning_streams_follow_the_specification(start_server, scripted_dir):  # noqa: F811
    server = start_server("--model", str(scripted_dir), "--model-id", "tiny")
    events = check_stream(server, {"model": "tiny", "input": "Lamp?", "temperature": 0, "max_output_tokens": 20})
    check_order(events)
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    types.ResponseResource.model_validate(final)


def test_tool_call_streams_follow_the_specification(start_server, caller_dir):  # noqa: F811
    server = start_server("--model", str(caller_dir), "--model-id", "tiny")
    events = check_stream(server, {"model": "tiny", "input": [QUESTION], "tools": TOOLS, "temperature": 0,
                                   "max_output_tokens": 40})
    check_order(events)
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "function_call", "function_call"]


def test_requests_arriving_together_are_all_answered(tiny_server):
    """One slow request and seven short ones at once, mixed sync and streamed, on both
    routes: every one is served (queued behind the others), none gets a 5xx."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        body = {"model": "tiny", "input": f"Request {i}: count these tokens", "temperature": 0,
                "max_output_tokens": 400 if i == 0 else 6, "stream": i % 2 == 1}
        route = "/v1/responses" if i % 3 else "/lmsp/v1/responses"
        r = HTTP.post(tiny_server.url + route, json=body, timeout=300)
        return r.status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [200] * 8


def test_request_settings_come_back_and_objects_validate_against_the_openai_sdk(tiny_server):
    """What a client set is what it reads back (sync, stored, streamed); nulls mean "not
    given"; every object validates against the OpenAI SDK's own types, usage included."""
    from openai.types.responses import Response

    settings = {"metadata": {"run": "7"}, "parallel_tool_calls": False, "reasoning": {"effort": "low", "summary": "auto"},
                "user": "u1", "prompt_cache_key": "k1", "safety_identifier": "s1", "max_tool_calls": 3,
                "text": {"format": {"type": "text"}, "verbosity": "low"}}
    body = {"model": "tiny", "input": "Count these tokens", "temperature": 0, "max_output_tokens": 4,
            "stream": None, "store": None, "top_p": None, **settings}
    sync = HTTP.post(tiny_server.url + "/v1/responses", json=body, timeout=120).json()
    stored = HTTP.get(f"{tiny_server.url}/v1/responses/{sync['id']}").json()  # null store: OpenAI's default, stored
    streamed = check_stream(tiny_server, body)
    for resp in (sync, stored, streamed[-1]["response"]):
        assert {k: resp[k] for k in settings} == settings
        Response.model_validate(resp)
        types.ResponseResource.model_validate(resp)
        assert resp["usage"]["input_tokens_details"]["cache_write_tokens"] == \
            resp["usage"]["input_tokens"] - resp["usage"]["input_tokens_details"]["cached_tokens"]
    # Cut by the token limit: the item's done event says so, as the final response does.
    done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
    assert streamed[-1]["type"] == "response.incomplete"
    assert [i["status"] for i in done] == [o["status"] for o in streamed[-1]["response"]["output"]] == ["incomplete"]
    bad = HTTP.post(tiny_server.url + "/v1/responses", json={**body, "metadata": {"n": 1}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.n"


def test_input_items_are_listed_and_a_deleted_response_is_gone(tiny_server):
    import openai

    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    said = ["first", "second", "third"]
    r = sdk.responses.create(model="tiny", input=[{"role": "user", "content": t} for t in said], temperature=0,
                             max_output_tokens=2)
    items = sdk.responses.input_items.list(r.id)  # newest first, as on OpenAI
    assert [i.content[0].text for i in items.data] == said[::-1]
    assert len({i.id for i in items.data}) == 3 and all(i.type == "message" and i.role == "user" for i in items.data)
    page = sdk.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == said[:2] and page.has_more
    rest = sdk.responses.input_items.list(r.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == said[2:] and not rest.has_more
    assert sdk.responses.delete(r.id) is None
    for gone in (lambda: sdk.responses.retrieve(r.id), lambda: sdk.responses.delete(r.id),
                 lambda: sdk.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_a_background_response_is_polled_and_cancelled(serial_server):
    import time

    import openai

    sdk = openai.OpenAI(base_url=serial_server.url + "/v1", api_key="unused", max_retries=0)
    short = {"model": "tiny", "input": "Count these tokens", "temperature": 0, "max_output_tokens": 6}
    started = sdk.responses.create(**short, background=True)
    assert started.background and started.status in ("queued", "in_progress") and started.output == []
    deadline = time.monotonic() + 60
    while (polled := sdk.responses.retrieve(started.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.status == "incomplete" and polled.background
    assert polled.output_text == sdk.responses.create(**short, store=False).output_text
    with pytest.raises(openai.BadRequestError):  # only background ones can be cancelled
        sdk.responses.cancel(sdk.responses.create(**short).id)
    endless = sdk.responses.create(**{**short, "max_output_tokens": 20000}, background=True)
    waiting = sdk.responses.create(**{**short, "max_output_tokens": 20000}, background=True)
    assert sdk.responses.retrieve(waiting.id).status == "queued"  # behind the endless one
    assert sdk.responses.cancel(waiting.id).status == "cancelled"
    cancelled = sdk.responses.cancel(endless.id)
    assert cancelled.status == "cancelled" and sdk.responses.retrieve(endless.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # nothing to poll without the store
        sdk.responses.create(**short, background=True, store=False)


def _checked(events) -> list[dict]:
    out = [e.to_dict(mode="json") for e in events]  # as sent: the fields the server set
    for data in out:
        EVENTS[data["type"]].model_validate(data)
    return out


def test_a_background_stream_survives_its_client_and_is_resumed(tiny_server):
    import time

    import openai

    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    body = {"model": "tiny", "input": "Count these tokens", "temperature": 0, "max_output_tokens": 12}
    seen = []
    with sdk.responses.create(**body, background=True, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 5:
                break  # the client's connection drops here
    response_id = seen[0].response.id
    assert seen[0].type == "response.created" and seen[0].response.background
    deadline = time.monotonic() + 60
    while (polled := sdk.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.status == "incomplete" and polled.background  # it ran to its end without a client
    assert polled.output_text == sdk.responses.create(**body, store=False).output_text

    whole = _checked(sdk.responses.retrieve(response_id, stream=True))  # from the start
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[:5] == [e.to_dict(mode="json") for e in seen]  # what the client got first
    assert whole[-1]["type"] == "response.incomplete" and whole[-1]["response"]["output"] == polled.to_dict(
        mode="json")["output"]
    assert "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta") == polled.output_text

    resumed = _checked(sdk.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    assert resumed == whole[5:]  # exactly what the client missed
    with sdk.responses.stream(response_id=response_id, starting_after=3) as stream:  # the SDK's own resume
        assert [e.sequence_number for e in stream] == list(range(4, len(whole)))
    for past in (len(whole), 2**63 - 1, 10**30):  # past the end: nothing more
        assert _checked(sdk.responses.retrieve(response_id, stream=True, starting_after=past)) == []
    for bad in ("x", "-2"):
        r = HTTP.get(f"{tiny_server.url}/v1/responses/{response_id}", params={"stream": "true", "starting_after": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
    r = HTTP.get(f"{tiny_server.url}/v1/responses/resp_missing", params={"stream": "true"})
    assert r.status_code == 404
    sdk.responses.delete(response_id)  # its events held its output too: they go with it
    assert HTTP.get(f"{tiny_server.url}/v1/responses/{response_id}", params={"stream": "true"}).status_code == 404


def test_a_cancelled_background_stream_ends_for_every_follower(serial_server):
    import openai

    sdk = openai.OpenAI(base_url=serial_server.url + "/v1", api_key="unused", max_retries=0)
    body = {"model": "tiny", "input": "Count these tokens", "temperature": 0, "max_output_tokens": 20000}
    with sdk.responses.create(**body, background=True, stream=True) as stream:
        first = next(iter(stream))
        with sdk.responses.create(**body, background=True, stream=True) as waiting:  # behind the first
            created = next(iter(waiting))
            assert created.response.status == "queued"  # as GET says
            assert sdk.responses.retrieve(created.response.id).status == "queued"
            assert sdk.responses.cancel(created.response.id).status == "cancelled"
            never_ran = _checked(waiting)
        assert [e["type"] for e in never_ran] == ["response.failed"]  # no in_progress: it never started
        assert sdk.responses.cancel(first.response.id).status == "cancelled"
        rest = _checked(stream)  # the stream it was started with ends too
    assert rest[-1]["type"] == "response.failed" and rest[-1]["response"]["status"] == "cancelled"
    again = _checked(sdk.responses.retrieve(first.response.id, stream=True, starting_after=0))
    assert again == rest
    assert sdk.responses.retrieve(first.response.id).status == "cancelled"


def test_input_tokens_are_counted_without_generating(tiny_server):
    import openai

    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    body = {"model": "tiny", "input": "Count these tokens", "instructions": "Be brief.", "temperature": 0,
            "max_output_tokens": 2}
    counted = sdk.responses.input_tokens.count(model="tiny", input=body["input"], instructions=body["instructions"])
    assert counted.input_tokens == sdk.responses.create(**body).usage.input_tokens
    before = tiny_server.log().count("request route=")
    assert sdk.responses.input_tokens.count(input="x").input_tokens > 0  # model is optional
    assert tiny_server.log().count("request route=") == before  # nothing was generated
    with pytest.raises(openai.BadRequestError):  # a stored response is not streamed again
        list(sdk.responses.retrieve(sdk.responses.create(**body).id, stream=True))


def test_a_streamed_response_is_readable_while_it_runs_and_kept_when_its_client_leaves(tiny_server):
    import time

    body = {"model": "tiny", "input": "Count these tokens", "temperature": 0, "max_output_tokens": 20000, "stream": True}
    with HTTP.stream("POST", tiny_server.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.created"' in line:
                response_id = json.loads(line[6:])["response"]["id"]
            if '"response.output_text.delta"' in line:  # still reading: it runs
                running = HTTP.get(f"{tiny_server.url}/v1/responses/{response_id}").json()
                assert running["status"] == "in_progress" and running["id"] == response_id
                break  # httpx closes the connection here
    # The client left mid-stream: generation stops, and the response is still stored (store
    # is OpenAI's default), cancelled, with the text it had.
    deadline = time.monotonic() + 60
    while (kept := HTTP.get(f"{tiny_server.url}/v1/responses/{response_id}").json())["status"] == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert kept["status"] == "cancelled" and kept["output"][0]["content"][0]["text"]


def test_generate_false_prewarms_the_kv_and_answers_nothing(tiny_server):
    body = {"model": "tiny", "input": "A prewarmed prompt, long enough to notice", "instructions": "Be brief.",
            "temperature": 0, "max_output_tokens": 8}
    warm = HTTP.post(tiny_server.url + "/v1/responses", json={**body, "generate": False}, timeout=60).json()
    assert warm["status"] == "completed" and warm["output"] == [] and warm["usage"]["output_tokens"] == 0
    # The turn that follows (Codex chains it with previous_response_id and no new input) finds
    # the prompt already in the KV, and no invented answer in its history.
    turn = HTTP.post(tiny_server.url + "/v1/responses", timeout=60, json={
        **body, "input": [], "previous_response_id": warm["id"]}).json()
    assert turn["usage"]["input_tokens"] == warm["usage"]["input_tokens"]
    assert turn["usage"]["input_tokens_details"]["cached_tokens"] >= warm["usage"]["input_tokens"] - 1
    assert turn["usage"]["output_tokens"] == 8
