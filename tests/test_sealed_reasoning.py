"""Encrypted reasoning state on /v1 (`include: ["reasoning.encrypted_content"]`): what
Codex and other stateless clients send back so the server can render the hidden reasoning
the client never saw.

The scripted model reasons " the" (sampled as three tokens, Ġt h e, where a fresh
tokenization has one, Ġthe) and calls two tools; its chat template drops earlier reasoning.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import HTTP, source_of
from tests.test_tools import QUESTION, TOOLS, outputs_for
from tests.tiny_model import CALLS, TOOL_SCRIPT, build_scripted_model

INCLUDE = ["reasoning.encrypted_content"]


def ask(server, input_: list, **fields) -> httpx.Response:
    body = {"model": "tiny", "input": input_, "tools": TOOLS, "temperature": 0, "max_output_tokens": 40,
            "store": False, "include": INCLUDE, **fields}
    return source_of(server, lambda: HTTP.post(server.url + "/v1/responses", json=body, timeout=120))


def unseal(key_file: Path, token: str) -> dict:
    """What the server sealed, opened with its key as the docs describe the format."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    assert token.startswith("lmsp1.")
    raw = base64.urlsafe_b64decode(token[6:] + "=" * (-len(token[6:]) % 4))
    return json.loads(AESGCM(key_file.read_bytes()).decrypt(raw[:12], raw[12:], b"reasoning"))


@pytest.fixture
def key_file(tmp_path) -> Path:
    return tmp_path / "keys" / "state.key"


def test_the_key_file_is_made_private_and_the_reasoning_sealed_with_it(start_server, caller_dir, key_file):
    server = start_server("--model", str(caller_dir), "--model-id", "tiny", "--state-key-file", str(key_file))
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_bytes()) == 32
    resp = ask(server, [QUESTION]).json()
    reasoning = resp["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["summary"][0]["text"] == " the"
    # The exact text the KV holds, tags included, not the summary shown.
    assert unseal(key_file, reasoning["encrypted_content"])["raw"] == "<think> the</think>"
    # Not asked for: null, as OpenAI sends it.
    plain = ask(server, [QUESTION], include=None).json()
    assert plain["output"][0]["encrypted_content"] is None


def test_streamed_reasoning_items_carry_it_in_output_item_done(start_server, caller_dir):
    server = start_server("--model", str(caller_dir), "--model-id", "tiny")
    body = {"model": "tiny", "input": [QUESTION], "tools": TOOLS, "temperature": 0, "max_output_tokens": 40,
            "store": False, "include": INCLUDE, "stream": True}
    done = []
    with HTTP.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["type"] == "response.output_item.done" and event["item"]["type"] == "reasoning":
                    done.append(event["item"])
                if event["type"] == "response.completed":
                    final = event["response"]["output"][0]
    assert len(done) == 1 and done[0]["encrypted_content"].startswith("lmsp1.")
    assert final["encrypted_content"] == done[0]["encrypted_content"]


def test_a_replay_continues_live_and_after_all_state_is_gone_prefills_the_true_history(
        start_server, caller_dir, key_file, tmp_path):
    live = start_server("--model", str(caller_dir), "--model-id", "tiny", "--state-key-file", str(key_file))
    first = ask(live, [QUESTION]).json()
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    replay = [QUESTION, *first["output"], *outputs_for(calls)]
    held = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]  # its end-of-turn token is prefilled next
    on_live = ask(live, replay).json()
    assert on_live["usage"]["input_tokens_details"]["cached_tokens"] == held
    assert live.sources == ["cold", "visible"]

    # A new process with the same key and no KV state at all (no checkpoints either).
    fresh = start_server("--model", str(caller_dir), "--model-id", "tiny", "--state-key-file", str(key_file),
                         "--no-kv-disk")
    cold = ask(fresh, replay).json()
    assert cold["status"] == "completed" and fresh.sources == ["cold"]
    visible_only = [QUESTION, {**first["output"][0], "encrypted_content": None}, *replay[2:]]
    blind = ask(fresh, visible_only).json()
    # The true history holds the reasoning the template drops: <think>, Ġthe, </think>.
    assert cold["usage"]["input_tokens"] - blind["usage"]["input_tokens"] == 3
    # ... and is the live KV's text: the live prompt differs only by the sampled Ġt h e
    # against the fresh tokenization's Ġthe.
    assert on_live["usage"]["input_tokens"] - cold["usage"]["input_tokens"] == 2
    assert [i["type"] for i in cold["output"]] == [i["type"] for i in on_live["output"]]


@pytest.mark.parametrize("change", ["tampered", "foreign key", "foreign model", "not ours"])
def test_reasoning_state_that_does_not_open_is_400_naming_the_item(start_server, caller_dir, key_file, tmp_path,
                                                                   change):
    maker = start_server("--model", str(caller_dir), "--model-id", "tiny", "--state-key-file", str(key_file))
    first = ask(maker, [QUESTION]).json()
    sealed = first["output"][0]["encrypted_content"]
    judge = maker
    if change == "tampered":
        i = len(sealed) // 2
        sealed = sealed[:i] + ("A" if sealed[i] != "A" else "B") + sealed[i + 1:]
    elif change == "foreign key":
        judge = start_server("--model", str(caller_dir), "--model-id", "tiny")
    elif change == "foreign model":
        other = build_scripted_model(tmp_path / "other", script=TOOL_SCRIPT, words=CALLS, seed=12)
        judge = start_server("--model", str(other), "--model-id", "tiny", "--state-key-file", str(key_file))
    else:
        sealed = "gAAAAABmOpenAIStyleOpaqueBlob"
    calls = [i for i in first["output"] if i["type"] == "function_call"]
    r = ask(judge, [QUESTION, {**first["output"][0], "encrypted_content": sealed}, *first["output"][1:],
                    *outputs_for(calls)])
    assert r.status_code == 400, r.text
    error = r.json()["error"]  # /v1: OpenAI's error shape
    assert error["code"] == "invalid_request" and error["param"] == "input[1].encrypted_content"
    if change == "foreign model":
        assert "another model" in error["message"]
    assert HTTP.get(judge.url + "/healthz").status_code == 200


@pytest.mark.slow
def test_a_key_file_others_can_read_is_refused_at_start(caller_dir, tmp_path):
    import subprocess

    key = tmp_path / "state.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "lmsp_mlx.serve", "--model", str(caller_dir), "--state-key-file", str(key),
                        "--store", str(tmp_path / "s.sqlite3"), "--no-kv-disk"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "chmod 600" in r.stderr
    key.chmod(0o600)
    key.write_bytes(b"short")
    r = subprocess.run([sys.executable, "-m", "lmsp_mlx.serve", "--model", str(caller_dir), "--state-key-file", str(key),
                        "--store", str(tmp_path / "s.sqlite3"), "--no-kv-disk"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "holds 5 bytes" in r.stderr


def test_an_agent_loop_replaying_sealed_reasoning_continues_live_every_turn(start_server, tmp_path):
    """Codex's loop without Codex: reason and call, call again after the result (a one-token
    reply), answer after the second; each replay carries the sealed reasoning item."""
    from tests.test_codex import ANSWER, COUNT, LOOP, READ
    from tests.tiny_model import STEPPED_CHATML

    model = build_scripted_model(tmp_path / "looper", script=LOOP, words=(READ, COUNT, ANSWER), template=STEPPED_CHATML)
    server = start_server("--model", str(model), "--model-id", "tiny")
    tools = [{"type": "function", "name": "exec_command", "strict": False,
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
    history: list = [{"role": "user", "content": "What do my notes say?"}]
    for turn in range(3):
        resp = ask(server, history, tools=tools).json()
        history += resp["output"]
        history += [{"type": "function_call_output", "call_id": o["call_id"], "output": f"result {turn}"}
                    for o in resp["output"] if o["type"] == "function_call"]
        if turn:
            held = previous["usage"]["input_tokens"] + previous["usage"]["output_tokens"]
            assert resp["usage"]["input_tokens_details"]["cached_tokens"] >= held
        previous = resp
    assert resp["output"][0]["content"][0]["text"] == ANSWER
    assert server.sources == ["cold", "visible", "visible"]
