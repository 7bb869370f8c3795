"""The Codex CLI (`codex exec`, wire_api = "responses") against a real server.

Uses `codex` from PATH, or installs the @openai/codex npm package into a temporary folder
when npm is present; skipped where neither works (no npm, no registry)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import lookups_during
from tests.npm_tools import npm_tool
from tests.tiny_model import CALLS, STEPPED_CHATML, TOOL_SCRIPT, build_scripted_model

pytestmark = pytest.mark.slow  # an npm client


@pytest.fixture(scope="session")
def codex(tmp_path_factory) -> str:
    return npm_tool("codex", "@openai/codex", tmp_path_factory.mktemp("codex-npm"), timeout=180)


def codex_exec(codex: str, server, tmp_path: Path, prompt: str, *extra: str) -> subprocess.CompletedProcess:
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "lmsp"\n[model_providers.lmsp]\nname = "lmsp-mlx"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "LMSP_KEY"\n'
    )
    return subprocess.run([codex, "exec", "--skip-git-repo-check", *extra, prompt], cwd=work, stdin=subprocess.DEVNULL,
                          env={**os.environ, "CODEX_HOME": str(home), "LMSP_KEY": "unused"},
                          capture_output=True, text=True, timeout=300)


def test_codex_exec_completes_a_turn(codex, start_server, tmp_path):
    # Codex's instructions and tool list are ~37k tokens for this byte-level tokenizer.
    model = build_scripted_model(tmp_path / "caller", script=TOOL_SCRIPT, words=CALLS, context=262144)
    server = start_server("--model", str(model), "--model-id", "tiny")
    r = codex_exec(codex, server, tmp_path, "Say hello.")
    assert r.returncode == 0, r.stderr[-3000:]
    # The scripted reply: reasoning " the", then calls of functions Codex did not offer,
    # which stay text (no invented call reaches Codex).
    assert '"name": "get_weather"' in r.stdout
    log = server.log()
    assert "request route=v1 model=tiny" in log and "status=completed" in log
    assert "code=internal_error" not in log


# An agent's loop: reason and run one command, run another after its result, then answer.
READ = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "cat notes.txt"}}\n</tool_call>'
COUNT = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "wc -c notes.txt"}}\n</tool_call>'
ANSWER = "The notes say to water the ferns."
LOOP = ["Ċ", "<think>", "Ġt", "h", "e", "</think>", READ, "<|im_end|>",  # first turn ("\n")
        "ĉ", COUNT, "<|im_end|>",  # after one tool result ("\t")
        "Ġ", ANSWER, "<|im_end|>"]  # after two (" ")


def test_codex_exec_runs_two_commands_and_each_turn_continues_the_live_state(codex, start_server, tmp_path):
    model = build_scripted_model(tmp_path / "looper", script=LOOP, words=(READ, COUNT, ANSWER), context=262144,
                                 template=STEPPED_CHATML)
    server = start_server("--model", str(model), "--model-id", "tiny")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("water the ferns\n")
    # The commands only read; no sandbox, so the test does not depend on this machine's namespaces.
    run: dict = {}
    sources = lookups_during(server, lambda: run.update(r=codex_exec(codex, server, tmp_path, "What do my notes say?",
                                                                     "--sandbox", "danger-full-access")))
    r = run["r"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert ANSWER in r.stdout
    transcript = r.stdout + r.stderr
    assert "cat notes.txt" in transcript and "wc -c notes.txt" in transcript
    log = server.log()
    turns = re.findall(r"request route=v1 model=tiny prompt_tokens=(\d+) cached_tokens=(\d+)", log)
    assert len(turns) == 3 and "code=" not in log
    # Codex sends the whole history each turn (store: false, encrypted reasoning included);
    # the turns after a tool call continue the live KV: only the tool result is prefilled.
    assert sources == {"cold": 1, "visible": 2}
    for prompt, cached in turns[1:]:
        assert int(prompt) - int(cached) < 400 < int(cached)
