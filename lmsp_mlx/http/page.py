"""The chat page: static files (ui/) a browser gets at `/`, which talk to /v1/chat/completions.

`/` negotiates: a browser that asks for HTML gets the page; a client that asks for JSON or
anything (`*/*`), and every HEAD, gets the liveness answer it always got. The page and its
files need no token (they hold nothing); the page asks for one where the server has tokens.
"""

from __future__ import annotations

from pathlib import Path

from quart import Blueprint, Response, request

UI = Path(__file__).parent / "ui"
FILES = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}

bp = Blueprint("page", __name__)


def wants_page() -> bool:
    """A GET that prefers HTML to JSON (a browser's navigation)."""
    if request.method != "GET":
        return False
    accept = request.accept_mimetypes
    return accept.quality("text/html") > accept.quality("application/json") and "text/html" in accept.values()


def page() -> Response:
    return _file("index.html", "text/html; charset=utf-8")


@bp.get("/ui/<name>")
async def asset(name: str):
    if name not in FILES:
        return Response("not found", status=404, content_type="text/plain")
    return _file(name, FILES[name])


def _file(name: str, content_type: str) -> Response:
    resp = Response((UI / name).read_bytes(), content_type=content_type)
    resp.headers["Cache-Control"] = "no-cache"  # a new version of the server serves its own page
    resp.headers["Content-Security-Policy"] = "default-src 'self'; img-src 'self' data:; script-src 'self'"
    return resp
