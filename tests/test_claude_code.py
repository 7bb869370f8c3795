"""The Claude Code CLI (`claude -p`, ANTHROPIC_BASE_URL) against a real server.

Uses `claude` from PATH, or installs the @anthropic-ai/claude-code npm package (a native
binary per platform) into a temporary folder when npm is present; skipped where neither
works (no npm, no registry)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import lookups_during
from tests.npm_tools import npm_tool
from tests.tiny_model import STEPPED_CHATML, build_scripted_model

pytestmark = pytest.mark.slow  # an npm client

# What Claude Code needs offline: no telemetry, update checks or other calls besides the
# model's (CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC), and a bearer token for the server.
ENV = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "ANTHROPIC_AUTH_TOKEN": "unused", "DISABLE_AUTOUPDATER": "1"}


@pytest.fixture(scope="session")
def claude(tmp_path_factory) -> str:
    return npm_tool("claude", "@anthropic-ai/claude-code", tmp_path_factory.mktemp("claude-npm"))


def claude_p(claude: str, server, tmp_path: Path, prompt: str) -> subprocess.CompletedProcess:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    # Its own system prompt, with the two built-in tools the loop uses (all of them would be
    # ~74k tokens of this byte-level tokenizer to prefill cold, 36 s of this test on 2 cores).
    return subprocess.run([claude, "-p", prompt, "--output-format", "json", "--tools", "Bash,Read",
                           "--allowedTools", "Bash,Read"],
                          cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ENV, "HOME": str(home), "ANTHROPIC_BASE_URL": server.url})


def transcript(tmp_path: Path) -> list[dict]:
    """Claude Code's own record of the session (~/.claude/projects/<dir>/<session>.jsonl)."""
    [path] = (tmp_path / "home" / ".claude" / "projects").glob("*/*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


ANSWER = "The notes say to water the ferns."


def test_claude_code_runs_a_command_reads_a_file_and_answers_continuing_the_live_kv(claude, start_server, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("water the ferns\n")
    # An agent's loop: reason and run a command, read a file after its result, then answer.
    bash = ('<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "description": "List the files"}}'
            '\n</tool_call>')
    read = f'<tool_call>\n{{"name": "Read", "arguments": {{"file_path": "{work / "notes.txt"}"}}}}\n</tool_call>'
    loop = ["Ċ", "<think>", "Ġt", "h", "e", "</think>", bash, "<|im_end|>",  # first turn ("\n")
            "ĉ", read, "<|im_end|>",  # after one tool result ("\t")
            "Ġ", ANSWER, "<|im_end|>"]  # after two (" ")
    model = build_scripted_model(tmp_path / "looper", script=loop, words=(bash, read, ANSWER), context=65536,
                                 template=STEPPED_CHATML)
    server = start_server("--model", str(model), "--model-id", "tiny", "--model-alias", "claude-*=tiny")
    run: dict = {}
    sources = lookups_during(server, lambda: run.update(r=claude_p(claude, server, tmp_path, "What do my notes say?")))
    r = run["r"]
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads(r.stdout)
    assert result["result"] == ANSWER and result["is_error"] is False and result["num_turns"] == 3
    # Claude Code ran both tools and read their results.
    record = transcript(tmp_path)
    uses = [b for e in record if e.get("type") == "assistant" for b in e["message"]["content"]
            if b.get("type") == "tool_use"]
    assert [(u["name"], u["input"].get("command") or u["input"].get("file_path")) for u in uses] == \
        [("Bash", "ls"), ("Read", str(work / "notes.txt"))]
    results = json.dumps([e for e in record if e.get("type") == "user"])
    assert "notes.txt" in results and "water the ferns" in results
    log = server.log()
    turns = re.findall(r"request route=messages model=tiny prompt_tokens=(\d+) cached_tokens=(\d+)", log)
    assert len(turns) == 3 and "code=" not in log
    # Each turn after a tool call continues the live KV: only the new blocks are prefilled.
    assert sources == {"cold": 1, "visible": 2}
    for prompt, cached in turns[1:]:
        assert int(prompt) - int(cached) < 600 < int(cached)
