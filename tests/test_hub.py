"""`--model org/name`: a Hugging Face repo id, resolved by huggingface_hub itself.

No hub can be reached here, so both of its paths run against stand-ins:
- the cache: the tests build the hub's own cache layout (`models--org--name/refs/main`,
  `snapshots/<commit>/...`) under HF_HOME and start the server with HF_HUB_OFFLINE=1, so
  `snapshot_download` resolves it from the cache exactly as it would after a real download;
- the download: `hub_server.Hub` answers the hub's API on loopback and HF_ENDPOINT points
  at it, so `snapshot_download` downloads (with its progress bars and HF_TOKEN) as from
  huggingface.co.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import HTTP, ask
from tests.hub_server import Hub, Repo
from tests.test_cli import one_line_error, serve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, repo: str, model_dir: Path, ref: str = "main") -> Path:
    """`model_dir` as huggingface_hub caches a snapshot of `repo` at `ref` under HF_HOME `home`."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / ref).write_text(COMMIT)
    shutil.copytree(model_dir, root / "snapshots" / COMMIT)
    return root


@pytest.mark.slow
def test_a_cached_repo_id_is_served_offline_under_its_own_name(start_server, tiny_model_dir, tmp_path):
    hub_cache(tmp_path / "hf", "tiny-org/tiny-model", tiny_model_dir)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    server = start_server("--model", "tiny-org/tiny-model", env=env)
    assert [m["id"] for m in HTTP.get(server.url + "/v1/models").json()["data"]][0] == "tiny-org/tiny-model"  # the default, first
    r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(model="tiny-org/tiny-model"), timeout=120)
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
    assert "from the Hugging Face cache" in server.log()


@pytest.mark.slow
def test_a_revision_names_its_ref(start_server, tiny_model_dir, tmp_path):
    hub_cache(tmp_path / "hf", "tiny-org/tiny-model", tiny_model_dir, ref="v1")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    server = start_server("--model", "tiny-org/tiny-model@v1", env=env)
    assert [m["id"] for m in HTTP.get(server.url + "/v1/models").json()["data"]][0] == "tiny-org/tiny-model"  # the default, first


@pytest.mark.slow
def test_an_uncached_repo_id_offline_is_one_line_naming_it_and_how_to_fetch_it(tmp_path):
    done = serve("--model", "nobody/nothing", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    one_line_error(done, "'nobody/nothing'", "HF_HUB_OFFLINE", "hf download nobody/nothing")


@pytest.mark.slow
def test_a_revision_the_cache_lacks_is_one_line_naming_it(tiny_model_dir, tmp_path):
    hub_cache(tmp_path / "hf", "tiny-org/tiny-model", tiny_model_dir)
    done = serve("--model", "tiny-org/tiny-model@nope", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    one_line_error(done, "'tiny-org/tiny-model@nope'", "models pull tiny-org/tiny-model@nope", "--revision nope")


def hub_repo(model_dir: Path, tmp_path: Path) -> Repo:
    """`model_dir` as a repo on the hub, with files besides the ones a model needs."""
    folder = tmp_path / "repo"
    shutil.copytree(model_dir, folder)
    (folder / "README.md").write_text("# a tiny model\n")
    (folder / "pytorch_model.bin").write_bytes(bytes(4096))  # the PyTorch weights: mlx-lm reads safetensors
    return Repo.of(folder, COMMIT, refs=("main", "v1"))


@pytest.mark.slow
def test_an_uncached_repo_id_downloads_with_progress_then_starts_from_the_cache(start_server, tiny_model_dir,
                                                                               tmp_path):
    repo = hub_repo(tiny_model_dir, tmp_path)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_test_token"}
    with Hub({"tiny-org/tiny-model": repo}, token="hf_test_token") as hub:
        server = start_server("--model", "tiny-org/tiny-model", env={**env, "HF_ENDPOINT": hub.url})
        r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(model="tiny-org/tiny-model"), timeout=120)
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
        log = server.log()
        assert f"model tiny-org/tiny-model: downloading from {hub.url}" in log
        assert "Fetching 4 files: 100%" in log  # the hub's own progress bar
        fetched = {path.rsplit("/", 1)[1] for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path}
        assert fetched == set(repo.files) - {"README.md", "pytorch_model.bin"}  # only what mlx-lm loads
        # HF_TOKEN, on every request for the repo (huggingface_hub's own registry fetch goes without)
        assert {auth for _, path, auth in hub.requests if "tiny-org/tiny-model" in path} == {"Bearer hf_test_token"}
    # The hub gone, the next start finds the download in the cache and asks no network.
    again = start_server("--model", "tiny-org/tiny-model", env={**env, "HF_ENDPOINT": hub.url})
    assert "model tiny-org/tiny-model: from the Hugging Face cache" in again.log()


@pytest.mark.slow
def test_a_repo_revision_or_token_the_hub_refuses_is_one_line(tiny_model_dir, tmp_path):
    from tests.test_models_cli import models

    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_test_token"}
    with Hub({"tiny-org/tiny-model": hub_repo(tiny_model_dir, tmp_path)}, token="hf_test_token") as hub:
        env["HF_ENDPOINT"] = hub.url
        one_line_error(serve("--model", "nobody/nothing", env=env), "'nobody/nothing' is not on " + hub.url,
                       "private to the account of the token sent")
        for spec, needle in [("tiny-org/tiny-model@nope", "'tiny-org/tiny-model' has no revision 'nope'"),
                             ("tiny-org/tiny-model", "is private to others: set HF_TOKEN")]:
            done = models("pull", spec, env={**env, "HF_TOKEN": "" if "set HF_TOKEN" in needle else env["HF_TOKEN"]})
            assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr
        pulled = models("pull", "tiny-org/tiny-model@v1", env=env)
        assert pulled.returncode == 0 and pulled.stdout.strip().endswith("snapshots/" + COMMIT), pulled.stderr
        assert "Fetching 4 files: 100%" in pulled.stderr


def test_a_revision_may_hold_slashes():
    from lmsp_mlx.engine import hub

    assert hub.looks_like_repo_id("org/name@refs/pr/1") and hub.invalid("org/name@refs/pr/1") is None
    assert not hub.looks_like_repo_id("./org/name") and not hub.looks_like_repo_id("a/b/c")


@pytest.mark.parametrize("spec, why", [
    ("org/a..b", "Cannot have -- or .."),
    ("org/name.", "cannot start or end with"),
    ("org/" + "n" * 100, "maximum length is 96"),
    ("org/na$me", "a repo id is org/name or org/name@revision"),
    ("org/name@", "a repo id is org/name or org/name@revision"),
])
def test_a_repo_id_the_hub_would_refuse_is_one_line_saying_why(spec, why, tmp_path):
    from lmsp_mlx import flags, serve
    from tests.test_models_cli import models

    with pytest.raises(serve.StartError) as err:
        serve.build(flags.parse(["--model", spec, "--models-dir", str(tmp_path / "store")]))
    assert "\n" not in str(err.value) and "nor a Hugging Face repo id" in str(err.value) and why in str(err.value)
    if spec == "org/a..b":  # the CLI says the same, where huggingface_hub raised its own traceback
        pulled = models("pull", spec, env={"HF_HOME": str(tmp_path / "hf")})
        assert pulled.returncode == 2 and why in pulled.stderr and "Traceback" not in pulled.stderr
