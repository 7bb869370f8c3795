"""The official Anthropic Python SDK against a real server: what a tool built on it does
(create, stream with its accumulating helper, count_tokens, a tool loop), unchanged."""

from __future__ import annotations


import anthropic
import pytest

from tests.helpers import lookups_during
from tests.test_messages import QUESTION, TOOLS
from tests.tiny_model import ENDLESS

# The SDK no longer has sampling parameters (Anthropic's newer models take none); older
# clients send temperature, which the server still reads: greedy, for replies to compare.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def caller(start_module_server, caller_dir):
    return start_module_server("--model", str(caller_dir), "--model-id", "tiny")


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_create_stream_and_count_tokens(tiny_server):
    sdk = client(tiny_server)
    messages = [{"role": "user", "content": ENDLESS}]
    made = sdk.messages.create(model="tiny", max_tokens=10, messages=messages, extra_body=GREEDY)
    assert isinstance(made, anthropic.types.Message) and made.stop_reason == "max_tokens"
    assert made.content[0].type == "text" and made.usage.output_tokens == 10
    with sdk.messages.stream(model="tiny", max_tokens=10, messages=messages, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == made.content[0].text == final.content[0].text
    # The stream's usage, read from message_delta, is the whole turn's: the prompt came from the KV.
    assert final.usage.cache_read_input_tokens > 0
    counted = sdk.messages.count_tokens(model="tiny", messages=messages)
    assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted.input_tokens


def test_a_two_turn_tool_loop(caller):
    sdk = client(caller)
    first = sdk.messages.create(model="tiny", max_tokens=40, messages=[QUESTION], tools=TOOLS, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use", "tool_use"]
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses[0].input == {"city": "Paris"}
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": f"ok {u.name}"} for u in uses]
    turn = [QUESTION, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    got = {}

    def second_turn():
        with sdk.messages.stream(model="tiny", max_tokens=40, messages=turn, tools=TOOLS, extra_body=GREEDY) as stream:
            got["second"] = stream.get_final_message()

    assert lookups_during(caller, second_turn) == {"visible": 1}
    second = got["second"]
    assert second.content[0].type == "thinking" and second.content[0].signature.startswith("lmsp1.")
    # Only the tool results were prefilled: the rest continued the live KV.
    assert second.usage.cache_read_input_tokens == first.usage.input_tokens + first.usage.output_tokens


def test_errors_raise_the_sdks_exceptions(tiny_server):
    sdk = client(tiny_server)
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(model="tiny", max_tokens=8, messages=[{"role": "assistant", "content": "Hi"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="claude-opus-5-5", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])


def test_models_list_reads_the_served_models(tiny_server):
    page = client(tiny_server).models.list()
    assert "tiny" in [m.id for m in page.data]
    assert all(m.type == "model" and m.display_name == m.id for m in page.data)
