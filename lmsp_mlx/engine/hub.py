"""Models named by Hugging Face repo id (`org/name`, or `org/name@revision`).

They resolve through huggingface_hub's `snapshot_download`, first from its local cache with
no network, then by a download that shows the hub's own progress bars. HF_HOME,
HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN and HF_ENDPOINT are huggingface_hub's and are read as
it reads them. With HF_HUB_OFFLINE set, an id that is not cached is a one-line error that
says how to fetch it.

Only what mlx-lm loads is fetched: config, weights, tokenizer and chat template files.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("lmsp_mlx.engine")

# org/name as the hub allows them, with an optional @revision (branch, tag or commit)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]


class HubError(RuntimeError):
    """A repo id that cannot be resolved; the message is the one line to show."""


def looks_like_repo_id(text: str) -> bool:
    """`org/name...` rather than a path: one slash before any @revision (which may hold
    slashes, `refs/pr/1`), not leading (an id may still be malformed)."""
    return text.partition("@")[0].count("/") == 1 and not text.startswith(("/", "./", "../", "~"))


def invalid(spec: str) -> str | None:
    """Why `spec` is not a repo id the hub takes (org/name[@revision]), or None: our form,
    then huggingface_hub's own rules (no '--' or '..', at most 96 characters, ...)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo, at, revision = spec.partition("@")
    if not REPO_ID.match(spec) or (at and not revision):
        return "a repo id is org/name or org/name@revision, of letters, digits, '-', '_' and '.'"
    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        return str(exc).splitlines()[0]
    return None


def resolve(spec: str, pulling: bool = False) -> Path:
    """The local snapshot directory of `spec` (org/name[@revision]), downloaded if needed;
    `pulling`: for `python -m lmsp_mlx.models pull`, whose offline hint is not itself."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    if why := invalid(spec):
        raise HubError(f"{spec!r} is not a Hugging Face repo id: {why}")
    repo, _, revision = spec.partition("@")
    try:
        path = Path(snapshot_download(repo, revision=revision or None, local_files_only=True, allow_patterns=FILES))
        log.info("model %s: from the Hugging Face cache, %s", spec, path)
        return path
    except LocalEntryNotFoundError:
        pass
    except HFValidationError as exc:  # a rule `invalid` does not know yet
        raise HubError(f"{spec!r} is not a Hugging Face repo id: {str(exc).splitlines()[0]}") from None
    if constants.HF_HUB_OFFLINE:
        fetch = f"`hf download {repo}{' --revision ' + revision if revision else ''}`"
        hint = (f"unset HF_HUB_OFFLINE to download it (or fetch it with {fetch})" if pulling else
                f"fetch it first (`python -m lmsp_mlx.models pull {spec}`, or {fetch}), or unset HF_HUB_OFFLINE")
        raise HubError(f"model {spec!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
                       f"is set: {hint}")
    log.info("model %s: downloading from %s", spec, constants.ENDPOINT)
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=FILES))
    except GatedRepoError:
        raise HubError(f"model {spec!r} is gated on {constants.ENDPOINT}: accept its terms on its page, then set "
                       "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        whose = "the account of the token sent" if _token() else "others: set HF_TOKEN to see it"
        raise HubError(f"model {spec!r} is not on {constants.ENDPOINT}, or is private to {whose}") from None
    except RevisionNotFoundError:
        raise HubError(f"model {repo!r} has no revision {revision!r} on {constants.ENDPOINT} (a branch, tag or "
                       "commit)") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as exc:
        raise HubError(f"model {spec!r} cannot be fetched from {constants.ENDPOINT}: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def _token() -> str | None:
    """The token huggingface_hub would send (HF_TOKEN, or the one `hf auth login` saved)."""
    from huggingface_hub import get_token

    return get_token()
