"""`python -m lmsp_mlx.models`: list, pull and rm over the model store and the Hugging Face
cache (built here in the hub's own layout, offline: test_hub.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.test_hub import hub_cache

from tests.servers import ROOT

pytestmark = pytest.mark.slow  # python -m lmsp_mlx.models in a process of its own


def models(*args: str, env: dict) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "lmsp_mlx.models", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_list_pull_and_rm_over_the_store_and_the_hub_cache(tiny_model_dir, tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf")}
    store = tmp_path / "store"
    shutil.copytree(tiny_model_dir, store / "tiny-local")
    (store / "not-a-model").mkdir()
    hub_cache(tmp_path / "hf", "tiny-org/tiny-model", tiny_model_dir)
    listed = models("--models-dir", str(store), "list", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("tiny-local", "store"), ("tiny-org/tiny-model", "hub")]
    assert all(r[3] in ("KB", "MB") and float(r[2]) > 0 for r in rows)
    pulled = models("pull", "tiny-org/tiny-model", env=env)  # cached: found without a network
    assert pulled.returncode == 0 and pulled.stdout.strip().endswith("snapshots/" + "0123456789abcdef" * 2 + "01234567")
    for name in ("tiny-local", "tiny-org/tiny-model"):
        gone = models("--models-dir", str(store), "rm", name, env=env)
        assert gone.returncode == 0 and gone.stdout.startswith(f"removed {name}"), gone.stderr
    assert models("--models-dir", str(store), "list", env=env).stdout.splitlines()[1:] == []
    missing = models("--models-dir", str(store), "rm", "tiny-local", env=env)
    assert missing.returncode == 2 and "no model 'tiny-local'" in missing.stderr
    bad = models("pull", "not a repo", env=env)
    assert bad.returncode == 2 and "not a Hugging Face repo id" in bad.stderr
