"""POST /v1/chat/completions through the official OpenAI SDK: the same engine, KV sessions
and tool-call continuation as /v1/responses, in Chat Completions' shapes."""

from __future__ import annotations

import json

import openai
import pytest
from tests.helpers import HTTP, DEFAULT_MODEL_ID, source_of
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from lmsp_mlx.service.stops import StopScanner

COUNT = [{"role": "user", "content": "Count from 1 to 10, one number per line."}]


@pytest.fixture(scope="module")
def sdk(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.mark.slow
def test_a_chat_gets_the_reply_the_same_conversation_gets_on_responses(sdk):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
    chat = sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=messages, temperature=0, max_tokens=24)
    resp = sdk.responses.create(model=DEFAULT_MODEL_ID, input=messages, temperature=0, max_output_tokens=24, store=False)
    ChatCompletion.model_validate(chat.model_dump())
    assert chat.object == "chat.completion" and chat.model == DEFAULT_MODEL_ID and len(chat.choices) == 1
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == resp.output_text
    assert choice.finish_reason == ("length" if resp.status == "incomplete" else "stop")
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (resp.usage.input_tokens, resp.usage.output_tokens)


@pytest.mark.slow
def test_a_streamed_chat_has_the_sync_reply_and_usage_last(sdk):
    sync = sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=COUNT, temperature=0, max_completion_tokens=30)
    stream = sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=COUNT, temperature=0, max_completion_tokens=30,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == sync.choices[0].message.content
    *body, last, usage = chunks
    assert last.choices[0].finish_reason == sync.choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in body)
    assert usage.choices == [] and usage.usage.completion_tokens == 30
    assert usage.usage.prompt_tokens == sync.usage.prompt_tokens


@pytest.mark.slow
def test_a_stop_sequence_ends_the_reply_before_it_streamed_or_not(sdk):
    free = sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=COUNT, temperature=0, max_tokens=40)
    text = free.choices[0].message.content
    assert "4\n5" in text
    for stop in ("5", ["nothing like it", "4\n5"]):
        cut = sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=COUNT, temperature=0, max_tokens=40, stop=stop)
        expected = text[: text.index("5" if stop == "5" else "4\n5")]
        assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
        streamed = list(sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=COUNT, temperature=0,
                                                    max_tokens=40, stop=stop, stream=True,
                                                    stream_options={"include_usage": True}))
        pieces = [c.choices[0] for c in streamed if c.choices]
        assert "".join(p.delta.content or "" for p in pieces) == expected and pieces[-1].finish_reason == "stop"
        # The turn ends on the token that completes the stop: the same usage every time.
        assert streamed[-1].usage.completion_tokens == cut.usage.completion_tokens < free.usage.completion_tokens
        again = sdk.chat.completions.create(model=DEFAULT_MODEL_ID, messages=COUNT, temperature=0, max_tokens=40, stop=stop)
        assert again.usage.completion_tokens == cut.usage.completion_tokens


def test_the_stop_scanner_holds_back_only_what_may_begin_a_stop():
    s = StopScanner(["END", "\n\n"])
    assert s.feed("abc E") == ("abc ", False)  # "E" may begin END
    assert s.feed("N") == ("", False)
    assert s.feed("D tail") == ("", True)
    s = StopScanner(["END"])
    assert s.feed("abc EN") == ("abc ", False) and s.feed("d") == ("ENd", False) and s.flush() == ""
    assert s.feed("x E") == ("x ", False) and s.flush() == "E"


@pytest.mark.slow
def test_structured_output_through_the_sdk_parse(sdk):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)

    r = sdk.chat.completions.parse(model=DEFAULT_MODEL_ID, messages=[{"role": "user", "content": "Describe Paris."}],
                                   response_format=City, temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, City)


CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "strict": False,
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
              {"type": "function", "function": {"name": "get_time", "description": "Time in a zone.", "strict": False,
                                                "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]


def test_tool_calls_and_the_turn_after_them_continue_the_live_kv(start_server, caller_dir):  # noqa: F811
    server = start_server("--model", str(caller_dir), "--model-id", "tiny")
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    first = sdk.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert choice.message.reasoning_content == " the"  # the scripted model's reasoning, kept for the replay
    assert 2 <= first.usage.completion_tokens_details.reasoning_tokens < first.usage.completion_tokens
    messages.append(choice.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": c.function.name})}
                 for c in choice.message.tool_calls]
    second = source_of(server, lambda: sdk.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS,
                                                                   temperature=0, max_tokens=40))
    held = first.usage.prompt_tokens + first.usage.completion_tokens  # its end-of-turn token is prefilled next
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert server.sources == ["visible"]
    # A conversation from elsewhere: a call this server never made, replayed without its
    # reasoning (Chat has no place for it): answered, not refused.
    foreign = [messages[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_elsewhere", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_elsewhere", "content": "rain"}]
    answered = sdk.chat.completions.create(model="tiny", messages=foreign, tools=CHAT_TOOLS, temperature=0, max_tokens=8)
    assert answered.choices[0].finish_reason == "tool_calls"  # the script calls again, whatever it is told
    assert "route=chat" in server.log()
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}  # Chat's own shape of it
    narrowed = sdk.chat.completions.create(model="tiny", messages=messages[:1], tools=CHAT_TOOLS, temperature=0,
                                           max_tokens=40, tool_choice=allowed)
    assert [c.function.name for c in narrowed.choices[0].message.tool_calls] == ["get_time"]
    single = sdk.chat.completions.create(model="tiny", messages=messages[:1], tools=CHAT_TOOLS, temperature=0,
                                         max_tokens=40, parallel_tool_calls=False)
    assert [c.function.name for c in single.choices[0].message.tool_calls] == ["get_weather"]
    # The streamed form sends each call whole, with its index.
    streamed = sdk.chat.completions.create(model="tiny", messages=messages[:1], tools=CHAT_TOOLS, temperature=0,
                                           max_tokens=40, stream=True)
    calls = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.id, t.function.name) for t in calls] == \
        [(0, calls[0].id, "get_weather"), (1, calls[1].id, "get_time")]


@pytest.mark.parametrize("fields, status, code, param", [
    ({"n": 2}, 400, "invalid_request", "n"),
    ({"messages": []}, 400, "invalid_request", "messages"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, 400, "invalid_request", "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "unsupported_capability", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_nope", "content": "{}"}]},
     400, "unknown_call_id", "messages[1].tool_call_id"),
    ({"tool_choice": {"type": "function"}}, 400, "invalid_request", "tool_choice"),
    ({"temperature": "hot"}, 400, "invalid_request", "temperature"),
    ({"top_logprobs": 2}, 400, "invalid_request", "top_logprobs"),  # without logprobs: true
    ({"model": "gpt-9"}, 404, "model_not_found", "model"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]},
     400, "invalid_request", "tools[0].function.name"),
    ({"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     400, "invalid_request", "tool_choice.function.name"),
    ({"functions": [{"name": "f", "parameters": {}}]}, 400, "invalid_request", "functions"),
    ({"stop": ["x"] * 17}, 400, "invalid_request", "stop"),
    ({"stop": "x" * 257}, 400, "invalid_request", "stop"),
    ({"presence_penalty": 5}, 400, "invalid_request", "presence_penalty"),
    ({"messages": [{"role": "user"}]}, 400, "invalid_request", "messages[0].content"),
    ({"tools": CHAT_TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_news"}}]}}},
     400, "invalid_request", "tool_choice.tools"),
])
def test_bad_chat_requests_are_openai_errors(tiny_server, fields, status, code, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    r = HTTP.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")


def test_another_tokens_visible_transcript_does_not_open_its_hidden_state(start_server, caller_dir, tmp_path):  # noqa: F811
    # The live KV after a tool call holds the reasoning the transcript does not show. A
    # replay by visible transcript continues it for its own token only: another token that
    # replays the same transcript starts from what it sent itself.
    everything = ["responses:write", "responses:read", "models:read"]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": everything, "mallory": everything, "ops": ["admin"]}))
    server = start_server("--model", str(caller_dir), "--model-id", "tiny", "--tokens", str(tokens))
    ops = {"Authorization": "Bearer ops"}  # /metrics

    def client(who: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key=who, timeout=120, max_retries=0)

    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    first = client("alice").chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, temperature=0,
                                                    max_tokens=40)
    reply = first.choices[0].message.model_dump(exclude_none=True)
    reply.pop("reasoning_content")  # as most Chat clients replay it
    messages += [reply] + [{"role": "tool", "tool_call_id": c.id, "content": "{}"} for c in first.choices[0].message.tool_calls]
    theirs = source_of(server, lambda: client("mallory").chat.completions.create(
        model="tiny", messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=4), headers=ops)
    assert server.sources[-1] != "visible"
    held = first.usage.prompt_tokens + first.usage.completion_tokens  # its end-of-turn token is prefilled next
    assert theirs.usage.prompt_tokens_details.cached_tokens < held
    mine = source_of(server, lambda: client("alice").chat.completions.create(
        model="tiny", messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=4), headers=ops)
    assert server.sources[-1] == "visible" and mine.usage.prompt_tokens_details.cached_tokens == held
