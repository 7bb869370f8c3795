"""POST /v1/responses/compact and the requests that continue a compacted conversation:
from the checkpointed KV of its text where that is there, from the model's summary where not.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import HTTP, source_of
from tests.tiny_model import ENDLESS, FINISHES

HISTORY = [
    {"role": "user", "content": FINISHES},
    {"role": "assistant", "content": "Hello back. " * 40},
    {"role": "user", "content": ENDLESS + " " + "and more words " * 30},
    {"role": "assistant", "content": "Counted. " * 40},
]
NEXT = {"role": "user", "content": FINISHES}


def compact(server, route: str = "/v1/responses/compact", **fields) -> httpx.Response:
    body = {"model": "tiny", "input": HISTORY, "instructions": "Be brief.", "max_output_tokens": 12, **fields}
    return source_of(server, lambda: HTTP.post(server.url + route, json=body, timeout=120))


def ask(server, input_: list) -> dict:
    r = source_of(server, lambda: HTTP.post(server.url + "/v1/responses", timeout=120, json={
        "model": "tiny", "input": input_, "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 8,
        "store": False}))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def kv_dir(tmp_path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def server(start_server, tiny_model_dir, kv_dir, tmp_path):
    return start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--kv-disk-dir", str(kv_dir),
                        "--state-key-file", str(tmp_path / "state.key"))


def test_compact_returns_the_user_messages_and_one_compaction_item(server):
    from openresponses_types.types import CompactResource

    r = compact(server)
    assert r.status_code == 200, r.text
    body = r.json()
    CompactResource.model_validate(body)
    assert body["object"] == "response.compaction" and body["id"].startswith("resp_")
    kinds = [(i["type"], i.get("role")) for i in body["output"]]
    assert kinds == [("message", "user"), ("message", "user"), ("compaction", None)]
    assert body["output"][0]["content"] == [{"type": "input_text", "text": FINISHES}]
    assert body["output"][-1]["encrypted_content"].startswith("lmsp1.")
    assert body["usage"]["input_tokens"] > 300 and 0 < body["usage"]["output_tokens"] <= 12
    # The worker checkpoints the history's KV right after the reply is out.
    deadline = time.monotonic() + 10
    while "kv checkpoint reason=compaction kind=token" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)


def test_the_openai_sdk_compacts_and_continues(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    compacted = client.responses.compact(model="tiny", input=HISTORY, instructions="Be brief.")
    assert compacted.output[-1].type == "compaction"
    follow = client.responses.create(model="tiny", input=[*[i.to_dict() for i in compacted.output], NEXT],
                                     instructions="Be brief.", temperature=0, max_output_tokens=8, store=False)
    assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"


def test_continuing_a_compaction_prefills_only_the_new_message_and_says_what_the_full_replay_says(server):
    output = compact(server).json()["output"]
    continued = ask(server, [*output, NEXT])
    full = ask(server, [*HISTORY, NEXT])  # the same conversation sent whole
    assert continued["output"][0]["content"][0]["text"] == full["output"][0]["content"][0]["text"]
    assert continued["usage"]["input_tokens"] == full["usage"]["input_tokens"]
    # The compaction's KV (the whole history) is reused: only the new turn is prefilled.
    prefilled = continued["usage"]["input_tokens"] - continued["usage"]["input_tokens_details"]["cached_tokens"]
    assert prefilled < 40
    assert server.sources[1] in ("token", "text")


def test_after_a_restart_the_checkpoint_resumes_it_and_without_it_the_summary_does(
        start_server, tiny_model_dir, kv_dir, tmp_path):
    key = tmp_path / "state.key"
    first = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--kv-disk-dir", str(kv_dir),
                         "--state-key-file", str(key))
    output = compact(first).json()["output"]
    first.stop()
    again = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--kv-disk-dir", str(kv_dir),
                         "--state-key-file", str(key))
    resumed = ask(again, [*output, NEXT])
    assert again.sources == ["disk"]
    assert resumed["usage"]["input_tokens"] - resumed["usage"]["input_tokens_details"]["cached_tokens"] < 40
    # No checkpoint: the compaction item becomes the summary, the history is not re-sent.
    bare = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--no-kv-disk",
                        "--state-key-file", str(key))
    summarised = ask(bare, [*output, NEXT])
    assert "continuing from its summary" in bare.log()
    assert summarised["usage"]["input_tokens"] < resumed["usage"]["input_tokens"] // 2
    # Other instructions than the compacted ones: the summary too, not the stale text.
    r = HTTP.post(again.url + "/v1/responses", timeout=120, json={
        "model": "tiny", "input": [*output, NEXT], "instructions": "Be verbose.", "max_output_tokens": 4})
    assert r.status_code == 200 and "continuing from its summary" in again.log()


def test_bad_compaction_requests_get_clear_errors(server):
    r = compact(server, model=None)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = compact(server, model="gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    output = compact(server).json()["output"]
    sealed = output[-1]["encrypted_content"]
    output[-1] = {**output[-1], "encrypted_content": sealed[:-4] + ("AAAA" if not sealed.endswith("AAAA") else "BBBB")}
    r = HTTP.post(server.url + "/v1/responses", json={"model": "tiny", "input": [*output, NEXT]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[2].encrypted_content"
    # A reasoning item's sealed state is not a compaction's, and the reverse.
    r = HTTP.post(server.url + "/v1/responses", timeout=60, json={"model": "tiny", "input": [
        {"type": "reasoning", "summary": [], "encrypted_content": sealed}, NEXT]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].encrypted_content"


def test_the_lmsp_route_compacts_too(server):
    r = compact(server, route="/lmsp/v1/responses/compact")
    assert r.status_code == 200 and r.json()["object"] == "response.compaction"
    r = compact(server, route="/lmsp/v1/responses/compact", input="not a list", model="gpt-9")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")


def call_loop(server, input_: list, **fields) -> dict:
    from tests.test_tools import TOOLS

    r = source_of(server, lambda: HTTP.post(server.url + "/v1/responses", timeout=120, json={
        "model": "tiny", "input": input_, "tools": TOOLS, "temperature": 0, "max_output_tokens": 40, "store": False,
        **fields}))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tool_loop_continues_after_a_compaction_with_tool_outputs_alone(start_server, caller_dir, tmp_path):
    from tests.test_tools import QUESTION, TOOLS, outputs_for

    server = start_server("--model", str(caller_dir), "--model-id", "tiny", "--kv-disk-dir", str(tmp_path / "kv"))
    history = [QUESTION, {"role": "assistant", "content": "Let me look that up. " * 20}]
    compacted = compact(server, input=history, tools=TOOLS, instructions=None).json()["output"]
    turn = call_loop(server, [*compacted, QUESTION])
    calls = [i for i in turn["output"] if i["type"] == "function_call"]
    alone = call_loop(server, outputs_for(calls))  # only the results: the live turn, compacted history and all
    assert server.sources[-1] == "tool-output"
    whole = call_loop(server, [*compacted, QUESTION, *turn["output"], *outputs_for(calls)])
    assert alone["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def test_compacting_a_live_reasoning_turn_checkpoints_the_kv_it_holds(start_server, caller_dir, tmp_path):
    from tests.test_tools import QUESTION, TOOLS, outputs_for

    key, kv = tmp_path / "state.key", tmp_path / "kv"
    args = ("--model", str(caller_dir), "--model-id", "tiny", "--kv-disk-dir", str(kv), "--state-key-file", str(key))
    server = start_server(*args)
    first = call_loop(server, [QUESTION])
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    conversation = [QUESTION, *first["output"], *outputs_for(calls)]  # reasoning replayed without its sealed text
    compacted = compact(server, input=conversation, tools=TOOLS, instructions=None).json()["output"]
    deadline = time.monotonic() + 10
    while "kv checkpoint reason=compaction" not in server.log():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "reason=compaction kind=visible" in server.log() and "compaction skipped" not in server.log()
    server.stop()
    again = start_server(*args)
    resumed = call_loop(again, [*compacted, QUESTION])
    assert again.sources[0] == "disk" and "continuing from its summary" not in again.log()
    # Prefilled: the new question and its markup (about one token per byte here).
    assert resumed["usage"]["input_tokens"] - resumed["usage"]["input_tokens_details"]["cached_tokens"] < 60


def test_edge_cases_of_what_is_compacted(server, start_server, tiny_model_dir, tmp_path):
    # Nothing to compact.
    r = compact(server, input=[])
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    # A compaction item with nothing after it continues the conversation as it is.
    output = compact(server).json()["output"]
    r = HTTP.post(server.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": [output[-1]], "instructions": "Be brief.", "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    # A stored chain holding a compaction item, read by a server with another key: the
    # problem names previous_response_id, not an index into someone else's input.
    stored = HTTP.post(server.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": [*output, NEXT], "instructions": "Be brief.", "max_output_tokens": 4}).json()
    other = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--store", str(server_store(server)))
    r = HTTP.post(other.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "And then?", "previous_response_id": stored["id"], "max_output_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def server_store(server) -> Path:
    return Path(server.args[server.args.index("--store") + 1])
