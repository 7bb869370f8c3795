"""The Codex CLI (`codex exec`, wire_api = "responses") against a real server.

Uses `codex` from PATH, or installs the @openai/codex npm package into a temporary folder
when npm is present; skipped where neither works (no npm, no registry)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import CALLS, TOOL_SCRIPT, build_scripted_model  # noqa: E402


@pytest.fixture(scope="session")
def codex(tmp_path_factory) -> str:
    found = shutil.which("codex")
    if found:
        return found
    npm = shutil.which("npm")
    if not npm:
        pytest.skip("neither codex nor npm is installed")
    prefix = tmp_path_factory.mktemp("codex-npm")
    try:
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix), "@openai/codex"],
                       check=True, capture_output=True, timeout=180)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"@openai/codex did not install: {exc}")
    binary = prefix / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        pytest.skip("@openai/codex installed no codex binary")
    return str(binary)


def test_codex_exec_completes_a_turn(codex, start_server, tmp_path):
    # Codex's instructions and tool list are ~37k tokens for this byte-level tokenizer.
    model = build_scripted_model(tmp_path / "caller", script=TOOL_SCRIPT, words=CALLS, context=262144)
    server = start_server("--model", str(model), "--model-id", "tiny")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "lmsp"\n[model_providers.lmsp]\nname = "lmsp-mlx"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "LMSP_KEY"\n'
    )
    r = subprocess.run([codex, "exec", "--skip-git-repo-check", "Say hello."], cwd=work, stdin=subprocess.DEVNULL,
                       env={**os.environ, "CODEX_HOME": str(home), "LMSP_KEY": "unused"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # The scripted reply: reasoning " the", then calls of functions Codex did not offer,
    # which stay text (no invented call reaches Codex).
    assert '"name": "get_weather"' in r.stdout
    log = server.log()
    assert "request route=v1 model=tiny" in log and "status=completed" in log
    assert "code=internal_error" not in log
