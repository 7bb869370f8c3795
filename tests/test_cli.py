"""Start-up errors are one clear line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.servers import ROOT, free_port
from tests.helpers import HTTP

pytestmark = pytest.mark.slow  # each start-up error is a process's exit status and stderr


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A server that stops at a start-up error (a later --port wins over this one)."""
    import os

    return subprocess.run(
        [sys.executable, "-m", "lmsp_mlx.serve", "--port", str(free_port()), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )


def one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2
    assert "Traceback" not in done.stderr, done.stderr
    # Progress log lines may come first; the error is one line, and the last.
    errors = [l for l in done.stderr.splitlines() if l.startswith("lmsp-mlx: error:")]
    assert len(errors) == 1 and done.stderr.rstrip().endswith(errors[0]), done.stderr
    for needle in needles:
        assert needle in errors[0]


def test_missing_model_path(tmp_path):
    one_line_error(serve("--model", str(tmp_path / "nowhere")), "does not exist")


def test_model_path_is_a_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_text("x")
    one_line_error(serve("--model", str(f)), "not a directory")


@pytest.mark.parametrize(
    "files, needle",
    [
        ({}, "no config.json"),
        ({"config.json": "{not json"}, "not valid JSON"),
        ({"config.json": "{}"}, "model_type"),
        ({"config.json": '{"model_type": "llama"}'}, "no .safetensors"),
        ({"config.json": '{"model_type": "llama"}', "model.safetensors": "garbage"}, "tokenizer"),
    ],
)
def test_malformed_model_directory(tmp_path, files, needle):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    one_line_error(serve("--model", str(tmp_path)), needle)


def test_corrupt_weights(tmp_path, tiny_model_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    one_line_error(serve("--model", str(broken)), "cannot load")


@pytest.mark.parametrize(
    "flags, name",
    [(["--max-queue", "0"], "--max-queue"), (["--max-body-mb", "-1"], "--max-body-mb"),
     (["--max-batch", "0"], "--max-batch"), (["--max-batch", "-2"], "--max-batch"), (["--max-batch", "x"], "--max-batch"),
     (["--max-output-tokens", "0"], "--max-output-tokens"),
     (["--port", "70000"], "--port"), (["--ctx", "0"], "--ctx"),
     # nan would turn retention off without a word
     (["--store-retention", "nan"], "--store-retention"), (["--event-retention", "inf"], "--event-retention"),
     (["--kv-group-size", "32"], "--kv-bits"), (["--sse-keepalive", "nan"], "--sse-keepalive"),
     (["--cors-origin", "ui.example/app"], "--cors-origin"), (["--cors-origin", "null"], "--cors-origin"),
     (["--cors-origin", "https://*.example.com"], "--cors-origin"), (["--cors-origin", "http://x:99999"], "--cors-origin")],
)
def test_bad_flag_values(flags, name):
    done = serve(*flags)
    assert done.returncode == 2 and name in done.stderr and "Traceback" not in done.stderr


def test_a_port_in_use_is_refused_before_the_model_loads(tiny_model_dir):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        done = serve("--model", str(tiny_model_dir), "--port", str(held.getsockname()[1]))
    one_line_error(done, "cannot bind", "in use")
    assert "loading" not in done.stderr and "serving on" not in done.stderr


def test_a_model_name_is_found_in_the_model_store(start_server, tmp_path, tiny_model_dir):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "Mine")
    server = start_server("--model", "Mine", env={"LMSP_MODELS_DIR": str(tmp_path)})
    assert [m["id"] for m in HTTP.get(server.url + "/v1/models").json()["data"]][0] == "Mine"  # the default, first
