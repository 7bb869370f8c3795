"""Bearer tokens and their scopes (docs/api.md, Tokens and scopes).

Tokens come from `--api-key` (every scope) and a tokens file (`--tokens FILE`, JSON: each
token mapped to its list of scopes). A route declares the scope it needs with `@requires`;
a token without it gets 403 `insufficient_scope`. What a token creates (stored responses,
tasks, idempotency keys) belongs to it: the owner is a hash of the token, so the store
never holds a token itself. With no tokens configured every request is the one local owner
(the service then binds only to loopback).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..protocol.auth import LOCAL_OWNER, RESERVED, SCOPES
from ..protocol.problems import Problem


class TokensError(ValueError):
    """The tokens file is unusable; the message says where."""


@dataclass(frozen=True)
class Identity:
    owner: str
    scopes: frozenset[str]


@dataclass
class Tokens:
    by_token: dict[str, frozenset[str]] = field(default_factory=dict)

    @property
    def required(self) -> bool:
        return bool(self.by_token)

    @classmethod
    def load(cls, api_key: str | None, path: Path | None) -> "Tokens":
        tokens: dict[str, frozenset[str]] = {}
        if path is not None:
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise TokensError(f"cannot read the tokens file {path}: {exc}") from None
            if not isinstance(raw, dict):
                raise TokensError(f"{path}: expected a JSON object mapping each token to a list of scopes")
            if not raw:
                raise TokensError(f"{path}: no tokens in it (an empty file would leave every route open)")
            for token, scopes in raw.items():
                if not token.strip():
                    raise TokensError(f"{path}: a token is empty: a token must have at least one character")
                if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
                    raise TokensError(f"{path}: token {token[:4]!r}...: expected a list of scope names")
                if asked := RESERVED & set(scopes):
                    raise TokensError(f"{path}: scope {sorted(asked)[0]!r} is refused: this service never runs tools")
                if unknown := set(scopes) - SCOPES:
                    raise TokensError(f"{path}: unknown scope {sorted(unknown)[0]!r} (known: {', '.join(sorted(SCOPES))})")
                tokens[token] = frozenset(scopes)
        if api_key:
            tokens[api_key] = SCOPES
        return cls(tokens)

    def identify(self, header: str) -> Identity:
        """The caller behind an Authorization header; 401 if there is no valid token."""
        if not self.required:
            return Identity(LOCAL_OWNER, SCOPES)
        scheme, _, token = header.partition(" ")
        given = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() == "bearer" and given:
            for known, scopes in self.by_token.items():
                if hmac.compare_digest(given, known.encode()):
                    return Identity("tok_" + hashlib.sha256(known.encode()).hexdigest()[:24], scopes)
        raise Problem(
            "unauthorized",
            "a valid 'Authorization: Bearer <token>' (or 'x-api-key: <token>') header is required",
            headers={"WWW-Authenticate": 'Bearer realm="lmsp"'},
        )
