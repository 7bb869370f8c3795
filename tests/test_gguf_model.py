"""`--model FILE.gguf`: the file is converted into the model store once, found again by its
content's hash, and served under its file name; a file the converter cannot take is a
one-line start error. The GGUF is written here as llama.cpp writes one (tiny_model.py)."""

from __future__ import annotations

import shutil

import pytest
from tests.helpers import HTTP, ask
from tests.tiny_model import build_tiny_gguf

from lmsp_mlx import flags, serve


@pytest.fixture(scope="module")
def gguf(tiny_model_dir, tmp_path_factory):
    return build_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf")


def start_args(model, tmp_path) -> list[str]:
    return ["--model", str(model), "--models-dir", str(tmp_path / "store"), "--no-kv-disk",
            "--store", str(tmp_path / "s.sqlite3"), "--state-key-file", str(tmp_path / "key"), "--port", "1"]


def test_a_gguf_is_converted_once_and_served_under_its_name(start_server, gguf, tmp_path):
    store = tmp_path / "store"
    server = start_server("--model", str(gguf), "--models-dir", str(store))
    assert [m["id"] for m in HTTP.get(server.url + "/v1/models").json()["data"]][0] == "tiny-chat"  # the default, first
    r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(model="tiny-chat", max_output_tokens=4), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] > 0, r.text
    [converted] = [d for d in store.iterdir() if not d.name.startswith(".")]
    assert converted.name.startswith("tiny-chat-")
    weights = (converted / "model.safetensors").stat().st_mtime_ns
    # The same content under another name is the same model: no second conversion.
    again = shutil.copy(gguf, tmp_path / "renamed.gguf")
    second = start_server("--model", str(again), "--models-dir", str(store))
    assert "converted before" in second.log()
    assert [d for d in store.iterdir() if not d.name.startswith(".")] == [converted]
    assert (converted / "model.safetensors").stat().st_mtime_ns == weights


def test_an_unknown_architecture_is_one_line_naming_it(tiny_model_dir, tmp_path):
    other = build_tiny_gguf(tiny_model_dir, tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(serve.StartError, match="not mamba") as err:
        serve.build(flags.parse(start_args(other, tmp_path)))
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "store").iterdir())  # nothing half-converted is left


def test_a_truncated_gguf_is_one_line(gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(serve.StartError, match="cannot read") as err:
        serve.build(flags.parse(start_args(cut, tmp_path)))
    assert "\n" not in str(err.value)


def test_a_gguf_whose_model_cannot_load_leaves_nothing_in_the_store(tiny_model_dir, tmp_path):
    broken = build_tiny_gguf(tiny_model_dir, tmp_path / "holed.gguf", drop="blk.0.attn_q.weight")
    with pytest.raises(serve.StartError, match="holed.gguf converts, but mlx-lm cannot load") as err:
        serve.build(flags.parse(start_args(broken, tmp_path)))
    assert "\n" not in str(err.value) and "Missing 1 parameters" in str(err.value)
    assert not [d for d in (tmp_path / "store").iterdir() if not d.name.startswith(".")]  # not listed, not reused
