"""Opaque state the server hands to stateless clients and reads back: sealed with a key only
the server holds.

A reasoning item's `encrypted_content` (and a compaction item's) is the server's own state:
the exact hidden text the model sampled, which the client cannot see but replays verbatim.
It is sealed with AES-256-GCM (an authenticated cipher: any change to the bytes, or a
different key, fails to open), under a 32-byte key kept in `--state-key-file` (created on
first start, mode 0600). The plaintext names the model fingerprint, so state made for other
weights is recognised and refused rather than rendered into the wrong model's prompt.

Token format: `lmsp1.` + base64url(12-byte nonce + ciphertext + 16-byte tag). The
associated data is the purpose (`reasoning`, `compaction`), so one kind cannot stand in for
the other.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PREFIX = "lmsp1."
KEY_BYTES = 32


class SealError(ValueError):
    """State that does not open: tampered, another key, another model, not ours at all."""


class StateKeyError(Exception):
    """The key file cannot be created or used; the server does not start."""


def load_state_key(path: Path) -> bytes:
    """The key in `path`, created (32 random bytes, mode 0600) when the file does not exist.
    A key file others can read is refused, like ssh refuses a private key."""
    path = path.expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StateKeyError(f"cannot create the state key file {path}: {exc.strerror or exc}") from None
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
    try:
        mode = path.stat().st_mode
        key = path.read_bytes()
    except OSError as exc:
        raise StateKeyError(f"cannot read the state key file {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StateKeyError(f"the state key file {path} is accessible by others (mode {stat.S_IMODE(mode):o}); "
                            f"run: chmod 600 {path}")
    if len(key) != KEY_BYTES:
        raise StateKeyError(f"the state key file {path} holds {len(key)} bytes, not {KEY_BYTES}; "
                            "remove it to have a new key made (state sealed with the old one is then unreadable)")
    return key


class Sealer:
    def __init__(self, key: bytes, fingerprint: str) -> None:
        self._key = key
        self._aead = AESGCM(key)
        self.fingerprint = fingerprint

    def for_model(self, fingerprint: str) -> "Sealer":
        """The same key for another model's state: what one model sealed, another refuses."""
        return self if fingerprint == self.fingerprint else Sealer(self._key, fingerprint)

    def seal(self, purpose: str, payload: dict[str, Any]) -> str:
        plain = json.dumps({"model": self.fingerprint, **payload}, ensure_ascii=False).encode("utf-8", "surrogatepass")
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, plain, purpose.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode().rstrip("=")

    def open(self, purpose: str, token: str) -> dict[str, Any]:
        """The payload; SealError saying why it cannot be used."""
        if not isinstance(token, str) or not token.startswith(PREFIX):
            raise SealError("it was not issued by this server")
        body = token[len(PREFIX):]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            plain = self._aead.decrypt(raw[:12], raw[12:], purpose.encode())
        except (ValueError, InvalidTag):
            raise SealError("it does not authenticate: altered, or sealed with another server's key") from None
        payload = json.loads(plain.decode("utf-8", "surrogatepass"))
        if payload.get("model") != self.fingerprint:
            raise SealError("it was made by another model (or the same weights with another dtype or quantization)")
        return payload
