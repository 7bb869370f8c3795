"""KV reuse across turns: every lookup kind, through a real server, proven by cached_tokens.

`usage.input_tokens_details.cached_tokens` is what the server did not prefill; /metrics'
lookup counters say which lookup found it (conftest.source_of), and the log's
`cache_source=` line says so too (the first test reads it once).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import HTTP, source_of
from tests.tiny_model import SCRIPTED_REPLY


def respond(server, messages, route="/lmsp/v1/responses", model="tiny", **fields) -> dict:
    body = {"model": model, "input": messages, "temperature": 0, "max_output_tokens": 12, **fields}
    r = source_of(server, lambda: HTTP.post(server.url + route, json=body, timeout=120))
    assert r.status_code == 200, r.text
    return r.json()


def reply_text(resp: dict) -> str:
    """The visible reply: the message item's text."""
    return next((o["content"][0]["text"] for o in resp["output"] if o["type"] == "message"), "")


def raw_text(resp: dict) -> str:
    """The reply as the model sampled it: reasoning back inside its <think> tags."""
    thought = "".join(o["summary"][0]["text"] for o in resp["output"] if o["type"] == "reasoning")
    return (f"<think>{thought}</think>" if thought else "") + reply_text(resp)


def cached(resp: dict) -> int:
    return resp["usage"]["input_tokens_details"]["cached_tokens"]


def kv_after(resp: dict) -> int:
    """Tokens the KV holds after a turn: its prompt and every sampled token but the last,
    which no step fed (the next turn prefills it with its own text). A model that stopped
    by itself sampled its end-of-turn token last (not counted as output); a reply the
    limit cut sampled its last output token last."""
    u = resp["usage"]
    return u["input_tokens"] + u["output_tokens"] - (resp["status"] != "completed")


def visible_prompt(model_dir: Path, history: list[dict]) -> list[int]:
    """The tokens of the rendered request: what a server without live KV would prefill."""
    from lmsp_mlx.engine.render import render, to_chat_messages
    from lmsp_mlx.protocol.requests import parse_request
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return render(tokenizer, to_chat_messages(parse_request({"model": "tiny", "input": history}).items())).tokens


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture
def tiny_kv(start_server, tiny_model_dir):
    return start_server("--model", str(tiny_model_dir), "--model-id", "tiny")


@pytest.fixture
def scripted_kv(start_server, scripted_dir):
    return start_server("--model", str(scripted_dir), "--model-id", "tiny")


def test_a_replayed_conversation_prefills_only_the_new_turn(tiny_kv):
    history = [user("Tell me about the lighthouse keepers of the northern coast. " * 4)]
    first = respond(tiny_kv, history)
    assert cached(first) == 0
    for route in ("/lmsp/v1/responses", "/v1/responses"):
        history = history + [assistant(reply_text(first)), user("And in winter?")]
        nxt = respond(tiny_kv, history, route=route)
        # Everything the KV held after the last turn is reused: prompt and sampled reply.
        assert cached(nxt) == kv_after(first)
        assert nxt["usage"]["input_tokens"] - cached(nxt) < 40  # the new turn only (bytes, mostly)
        first = nxt
    assert tiny_kv.sources == ["cold", "visible", "visible"]
    assert f"cache_source=visible cached={cached(first)} prompt={first['usage']['input_tokens']}" in tiny_kv.log()


def test_hidden_reasoning_stays_in_the_live_kv(scripted_kv, scripted_dir):
    history = [user("What does the lamp say?")]
    first = respond(scripted_kv, history)
    assert raw_text(first) == SCRIPTED_REPLY  # "<think> the</think>OK": a reasoning item and "OK"
    assert reply_text(first) == "OK"
    # The template drops the <think> block of earlier turns, so a replay renders only "OK"
    # (whether the client sends the block or not); the KV continues with the reasoning.
    for i, replayed in enumerate(("OK", SCRIPTED_REPLY)):
        history = history + [assistant(replayed), user(f"Why {i}?")]
        nxt = respond(scripted_kv, history, route="/lmsp/v1/responses" if i == 0 else "/v1/responses")
        assert cached(nxt) == kv_after(first)
        # A cold start would prefill the visible transcript; this KV holds 5 more tokens:
        # <think>, " t", "h", "e", </think>.
        assert nxt["usage"]["input_tokens"] == len(visible_prompt(scripted_dir, history)) + 5 * (i + 1)
        first = nxt
    assert scripted_kv.sources == ["cold", "visible", "visible"]


def test_a_session_without_a_reply_is_continued_by_exact_token_prefix(tiny_kv):
    question = [user("Name three colours of the evening sky, one per line.")]
    # With one output token the sampled token is never fed back: the KV holds the prompt.
    first = respond(tiny_kv, question, max_output_tokens=1)
    nxt = respond(tiny_kv, question + [assistant("Red."), user("More?")])
    assert cached(nxt) == first["usage"]["input_tokens"]
    assert tiny_kv.sources == ["cold", "token"]


def test_a_shared_prefix_is_copied_and_the_first_session_survives(tiny_kv):
    system = {"role": "system", "content": "You are a careful archivist of river towns. " * 6}
    a = respond(tiny_kv, [system, user("First question about bridges?")])
    b = respond(tiny_kv, [system, user("Second question about mills?")])
    system_tokens = cached(b)
    assert 40 < system_tokens < b["usage"]["input_tokens"]  # the system prompt, not more
    # A's session was not cut down to the shared prefix: its replay still continues it.
    c = respond(tiny_kv, [system, user("First question about bridges?"), assistant(reply_text(a)), user("Go on.")])
    assert cached(c) == kv_after(a)
    assert tiny_kv.sources == ["cold", "token", "visible"]


def test_a_bpe_boundary_continues_by_text_prefix_like_a_cold_run(scripted_kv, scripted_dir):
    question = [user("Say it.")]
    # Cut after three tokens: the KV ends in "<think>", " t" ("h", sampled last, was never fed).
    first = respond(scripted_kv, question, max_output_tokens=3)
    assert first["output"][0]["summary"][0]["text"] == " th"  # inside the reasoning
    # The client continues that text; a fresh tokenization merges " the" into one token,
    # so the token prefix stops before " t", the text prefix keeps " t" and adds "he".
    history = question + [assistant("<think> the cat"), user("Continue.")]
    nxt = respond(scripted_kv, history)
    assert cached(nxt) == first["usage"]["input_tokens"] + 2
    assert scripted_kv.sources == ["cold", "text"]

    from lmsp_mlx.engine.batch import generate
    from lmsp_mlx.engine.generate import GenerationParams
    from lmsp_mlx.engine.loader import load_model

    lm = load_model(scripted_dir)
    pieces: list[str] = []
    generate(lm, GenerationParams(prompt=visible_prompt(scripted_dir, history), max_tokens=12, temperature=0),
             lambda e: pieces.append(getattr(e, "text", "")), lambda: False)
    assert raw_text(nxt) == "".join(pieces)  # the same text as a cold run


def test_a_restarted_server_resumes_from_its_shutdown_checkpoint(start_server, tiny_model_dir, tmp_path):
    kv = ["--model", str(tiny_model_dir), "--model-id", "tiny", "--kv-disk-dir", str(tmp_path / "kv")]
    history = [user("Describe the harbour at dawn, the boats and the nets. " * 6)]
    before = start_server(*kv)
    first = respond(before, history)
    before.stop()  # SIGTERM: the live session is written out
    assert "kv checkpoint reason=shutdown kind=visible" in before.log()

    after = start_server(*kv)
    nxt = respond(after, history + [assistant(reply_text(first)), user("And at dusk?")])
    assert cached(nxt) == kv_after(first)
    assert after.sources == ["disk"]


def test_a_long_prefill_is_checkpointed_and_evicted_sessions_come_back_from_disk(start_server, tiny_model_dir):
    # A tiny memory budget: each new conversation pushes the previous one out (to disk).
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny",
                          "--kv-memory-mb", "0.01", "--kv-checkpoint-min-tokens", "100")
    a = [user("Alpha: the first conversation, about orchards and frost. " * 3)]
    b = [user("Beta: the second conversation, about tides and moorings. " * 3)]
    ra = respond(server, a)  # the reply comes first, the checkpoint right after it
    server.wait_for_log("kv checkpoint reason=prefill kind=visible")
    respond(server, b)
    server.wait_for_log("kv memory: evicting a session")
    again = respond(server, a + [assistant(reply_text(ra)), user("More?")])
    assert cached(again) == kv_after(ra)
    assert server.sources == ["cold", "token", "disk"]  # b shares the template opening with a


def test_no_kv_disk_writes_nothing(start_server, tiny_model_dir, tmp_path):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--no-kv-disk",
                          "--kv-checkpoint-min-tokens", "1")
    respond(server, [user("Nothing of this goes to disk.")])
    server.stop()
    assert "kv checkpoint" not in server.log() and "kv disk" not in server.log()


def test_a_quantized_kv_cache_is_reused_checkpointed_and_kept_apart(start_server, tmp_path):
    from tests.tiny_model import build_tiny_model

    wide = build_tiny_model(tmp_path / "wide", head_dim=64)  # quantization groups need 32 or more
    kv = ["--model", str(wide), "--model-id", "tiny", "--kv-disk-dir", str(tmp_path / "kv")]
    history = [user("Describe the harbour at dawn, the boats and the nets. " * 6)]
    quantized = start_server(*kv, "--kv-bits", "8")
    model = HTTP.get(quantized.url + "/lmsp/v1/models/tiny").json()
    assert model["kv_cache"] == "8-bit, group 64"
    first = respond(quantized, history)
    again = respond(quantized, history)  # the same request from its own (quantized) KV
    assert reply_text(again) == reply_text(first) and cached(again) > 0
    follow = history + [assistant(reply_text(first)), user("And at dusk?")]
    live = respond(quantized, follow)
    assert cached(live) == kv_after(first)
    quantized.stop()
    assert "kv checkpoint reason=shutdown" in quantized.log()
    # A float-KV server on the same folder does not see the quantized checkpoints ...
    plain = start_server(*kv)
    assert respond(plain, follow)["usage"]["input_tokens_details"]["cached_tokens"] == 0
    plain.stop()
    # ... and a quantized one resumes from them, with the same reply as before the restart.
    back = start_server(*kv, "--kv-bits", "8")
    resumed = respond(back, follow)
    assert back.sources == ["disk"] and reply_text(resumed) == reply_text(live)


@pytest.mark.slow
def test_a_kv_quantization_the_model_cannot_take_is_refused_at_start(tiny_model_dir, tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "lmsp_mlx.serve", "--model", str(tiny_model_dir), "--kv-bits", "4",
                        "--store", str(tmp_path / "s.sqlite3"), "--no-kv-disk", "--state-key-file", str(tmp_path / "k")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--kv-bits 4 with --kv-group-size 64 does not fit" in r.stderr
    assert "Traceback" not in r.stderr
