"""Who calls a route, and whether its token may: `authorize` runs before every route (and
WebSocket handshake), identifies the caller from its bearer token (service/auth.py) into
`g.identity`, and checks the scope the route declared with `@requires`."""

from __future__ import annotations

from typing import Callable

from quart import g

from ..protocol.auth import LOCAL_OWNER, SCOPES
from ..protocol.problems import Problem
from ..service.auth import Identity, Tokens


def requires(scope: str) -> Callable:
    """Mark a route as needing `scope`; checked before the route runs."""
    assert scope in SCOPES

    def mark(fn: Callable) -> Callable:
        fn.required_scope = scope
        return fn

    return mark


def authorize(tokens: Tokens, view: Callable | None, method: str, path: str, headers) -> None:
    """Identify the caller of an HTTP request or WebSocket (kept in `g.identity`) and check
    the route's scope."""
    if path in ("/", "/healthz") or path.startswith("/ui/"):  # liveness and the chat page's files: nothing told
        g.identity = Identity(LOCAL_OWNER, frozenset())
        return
    # Anthropic's clients send their key as `x-api-key` (Claude Code's ANTHROPIC_AUTH_TOKEN
    # is a bearer token): the same tokens either way.
    key = headers.get("x-api-key")
    identity = tokens.identify(headers.get("Authorization") or (f"Bearer {key}" if key else ""))
    g.identity = identity
    needed = getattr(view, "required_scope", None)
    if needed is not None and needed not in identity.scopes:
        raise Problem("insufficient_scope", f"this token lacks the scope {needed!r} that {method} {path} needs")
