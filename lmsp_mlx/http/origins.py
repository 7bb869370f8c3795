"""Web pages as clients: which browser origins may call this service (CORS), and why the rest
are refused.

SDKs, curl and Codex send no `Origin`; a browser sends one with every cross-origin request,
every POST and every WebSocket handshake. Without tokens the service trusts whoever can
reach its loopback address, and a page the user merely visits can reach it too: a
WebSocket needs no CORS permission to read its replies, and a `text/plain` POST needs no
preflight. So on a service without tokens a request whose `Origin` is not allowed is
refused (403) before it runs. With tokens the token is what protects it (a browser does not
add one on its own), and other origins only go without CORS headers.

Allowed: loopback pages (`http://localhost:3000`, `http://127.0.0.1:*`, `http://[::1]:*`),
which a local web UI is, and what `--cors-origin` names (`*`: any page). An allowed origin
gets `Access-Control-Allow-Origin` on every reply and an answer to its preflights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from quart import Response

from ..protocol.problems import Problem

_LOOPBACK = re.compile(r"^https?://(localhost|[a-z0-9-]+\.localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?$")
_DEFAULT_PORT = {"http": 80, "https": 443}


def normalized(origin: str) -> str:
    """`origin` as a browser sends it (lowercase scheme and host, no default port), for
    comparing. ValueError for anything but an http(s) origin: `null` included, which any
    page can send from a sandboxed frame."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port  # out of range: ValueError
    except ValueError as exc:
        raise ValueError(f"{origin!r} is not a web page origin ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORT or not parts.hostname or "*" in parts.netloc or parts.username is not None \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{origin!r} is not a web page origin (like https://ui.example:8443)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != _DEFAULT_PORT[scheme] else "")

# What a page may read besides the CORS-safelisted headers: a task's Location, a 429's
# Retry-After, the protocol version.
EXPOSED = "Location, Retry-After, LMSP-Version"
METHODS = "GET, POST, DELETE, OPTIONS"


@dataclass(frozen=True)
class Origins:
    extra: tuple[str, ...] = ()  # --cors-origin values, normalized ("https://ui.example:8443"), or "*"
    enforce: bool = True  # refuse origins not allowed (a service without tokens)

    def allows(self, origin: str) -> bool:
        try:
            origin = normalized(origin)
        except ValueError:
            return False
        return "*" in self.extra or origin in self.extra or bool(_LOOPBACK.match(origin))

    def check(self, origin: str | None) -> None:
        """Before a request or WebSocket handshake runs: 403 for a page that may not call it."""
        if origin is None or not self.enforce or self.allows(origin):
            return
        try:
            hint = f"start the server with --cors-origin {normalized(origin)} to let that page use it"
        except ValueError:  # null (a file:// page, a sandboxed frame), or no web origin at all
            hint = "serve the page from http://localhost, or give the server tokens (--api-key)"
        raise Problem("insufficient_scope", f"requests from the web page origin {origin!r} are refused; {hint}")

    def preflight(self, method: str, headers) -> Response | None:
        """The answer to a browser's CORS preflight (OPTIONS) from an allowed origin."""
        origin = headers.get("Origin")
        if method != "OPTIONS" or origin is None or "Access-Control-Request-Method" not in headers:
            return None
        if not self.allows(origin):
            return Response("", status=403)
        resp = Response("", status=204)
        resp.headers["Access-Control-Allow-Methods"] = METHODS
        # Whatever the page's client sends (Authorization, Idempotency-Key, the OpenAI SDK's x-stainless-*)
        resp.headers["Access-Control-Allow-Headers"] = headers.get("Access-Control-Request-Headers", "")
        resp.headers["Access-Control-Max-Age"] = "600"
        return resp

    def decorate(self, resp: Response, origin: str | None) -> None:
        if origin is not None and self.allows(origin):
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Access-Control-Expose-Headers"] = EXPOSED
        resp.vary.add("Origin")
