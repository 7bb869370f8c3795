"""The models this machine holds, wherever they are: the model store (converted GGUF files,
the default model, directories put there) and the local Hugging Face cache.

Only directories mlx-lm can load are listed (config.json with a model_type, safetensors
weights); a GGUF-only or PyTorch-only repo in the hub's cache is not. Nothing here loads
a model: the listing reads file names, headers and sizes.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

log = logging.getLogger("lmsp_mlx.models")

Where = Literal["store", "hub"]


@dataclass(frozen=True)
class Listed:
    id: str  # the store's directory name, or the hub's org/name
    where: Where
    path: Path  # the directory mlx-lm loads (for the hub: the snapshot refs/main names, else the newest)
    size_bytes: int  # on disk (for the hub: every cached revision)


def is_mlx_dir(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config and any(path.glob("*.safetensors"))


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def store_models(models_dir: Path) -> list[Listed]:
    if not models_dir.is_dir():
        return []
    return [Listed(d.name, "store", d, _size(d)) for d in sorted(models_dir.iterdir())
            if not d.name.startswith(".") and d.is_dir() and is_mlx_dir(d)]


def hub_models() -> list[Listed]:
    """The mlx-lm models in the Hugging Face cache (HF_HOME / HF_HUB_CACHE)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        snapshot = next((r.snapshot_path for r in revisions if is_mlx_dir(r.snapshot_path)), None)
        if snapshot is not None:
            found.append(Listed(repo.repo_id, "hub", snapshot, repo.size_on_disk))
    return found


def remove(listed: Listed) -> None:
    """Delete a model from the store, or every cached revision of a hub repo (through
    huggingface_hub's own cache deletion, which keeps the cache's blobs consistent)."""
    if listed.where == "store":
        shutil.rmtree(listed.path)
        return
    from huggingface_hub import scan_cache_dir

    cache = scan_cache_dir()
    hashes = [rev.commit_hash for repo in cache.repos if repo.repo_id == listed.id and repo.repo_type == "model"
              for rev in repo.revisions]
    cache.delete_revisions(*hashes).execute()


# Thinking markers mlx-lm's tokenizer looks for, as JSON strings (both of a pair in the vocabulary).
THINK_PAIRS = ((b'"<think>"', b'"</think>"'), (b'"<longcat_think>"', b'"</longcat_think>"'),
               (b'"<|think:start|>"', b'"<|think:end|>"'))


def reasons(path: Path) -> bool:
    """Whether the model reasons, read without loading it: a pair of thinking tokens in its
    vocabulary (tokenizer.json, tokenizer_config.json), as mlx-lm's tokenizer decides it
    once loaded (`has_thinking`). Cached by the files' modification times."""
    stamps = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            stamps.append((path / name).stat().st_mtime_ns)
        except OSError:
            stamps.append(None)
    return _reasons(path, tuple(stamps))


@lru_cache(maxsize=256)
def _reasons(path: Path, stamps: tuple) -> bool:
    texts = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            texts.append((path / name).read_bytes())
        except OSError:
            pass
    return any(all(any(token in t for t in texts) for token in pair) for pair in THINK_PAIRS)


class Catalog:
    """Every model the server can serve, by id: the ones named on the command line (the
    first is the default), then the model store's, then the Hugging Face cache's."""

    def __init__(self, named: list, models_dir: Path, options, aliases: tuple[tuple[str, str], ...] = (),
                 named_only: bool = False) -> None:
        self.named = named  # ModelSpecs of --model
        self.named_only = named_only  # the --model models alone (a model split over ranks: nothing loads on demand)
        self.models_dir = models_dir
        self.options = options  # LoadOptions for the models found here (no adapter: that is a --model's)
        self.aliases = aliases  # --model-alias: (glob pattern, served id), the first match wins

    def resolve(self, model_id: str) -> str:
        """The id a requested name means: itself where a --model has that id, else the target
        of the first alias whose pattern it matches (Claude Code's `claude-*` names), else itself."""
        if any(s.id == model_id for s in self.named):
            return model_id
        return next((target for pattern, target in self.aliases if fnmatch.fnmatchcase(model_id, pattern)), model_id)

    @property
    def default_id(self) -> str:
        return self.named[0].id

    def find(self, model_id: str):
        from .slot import ModelSpec

        for spec in self.named:
            if spec.id == model_id:
                return spec
        found = next((m for m in self.listed() if m.id == model_id), None)
        return ModelSpec(found.id, found.path, self.options) if found is not None else None

    def listed(self) -> list[Listed]:
        """The store's and the hub cache's models that no --model already names."""
        if self.named_only:
            return []
        named = {s.id for s in self.named} | {s.path.resolve() for s in self.named}
        try:
            found = store_models(self.models_dir) + hub_models()
        except OSError as exc:
            log.warning("the model store or the Hugging Face cache cannot be listed: %s", exc)
            return []
        return [m for m in found if m.id not in named and m.path.resolve() not in named]
