"""`--model org/name`: a Hugging Face repo id, resolved by huggingface_hub itself.

No hub can be reached here, so the test builds the hub's own cache layout
(`models--org--name/refs/main`, `snapshots/<commit>/...`) under HF_HOME and starts the
server with HF_HUB_OFFLINE=1: `snapshot_download` resolves it from the cache exactly as it
would after a real download.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx

from conftest import ask
from test_cli import one_line_error, serve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, repo: str, model_dir: Path, ref: str = "main") -> Path:
    """`model_dir` as huggingface_hub caches a snapshot of `repo` at `ref` under HF_HOME `home`."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / ref).write_text(COMMIT)
    shutil.copytree(model_dir, root / "snapshots" / COMMIT)
    return root


def test_a_cached_repo_id_is_served_offline_under_its_own_name(start_server, tiny_model_dir, tmp_path):
    hub_cache(tmp_path / "hf", "tiny-org/tiny-model", tiny_model_dir)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    server = start_server("--model", "tiny-org/tiny-model", env=env)
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]][0] == "tiny-org/tiny-model"  # the default, first
    r = httpx.post(server.url + "/lmsp/v1/responses", json=ask(model="tiny-org/tiny-model"), timeout=120)
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
    assert "from the Hugging Face cache" in server.log()


def test_a_revision_names_its_ref(start_server, tiny_model_dir, tmp_path):
    hub_cache(tmp_path / "hf", "tiny-org/tiny-model", tiny_model_dir, ref="v1")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    server = start_server("--model", "tiny-org/tiny-model@v1", env=env)
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]][0] == "tiny-org/tiny-model"  # the default, first


def test_an_uncached_repo_id_offline_is_one_line_naming_it_and_how_to_fetch_it(tmp_path):
    done = serve("--model", "nobody/nothing", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    one_line_error(done, "'nobody/nothing'", "HF_HUB_OFFLINE", "hf download nobody/nothing")


def test_a_revision_the_cache_lacks_is_one_line_naming_it(tiny_model_dir, tmp_path):
    hub_cache(tmp_path / "hf", "tiny-org/tiny-model", tiny_model_dir)
    done = serve("--model", "tiny-org/tiny-model@nope", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    one_line_error(done, "'tiny-org/tiny-model@nope'", "models pull tiny-org/tiny-model@nope", "--revision nope")
