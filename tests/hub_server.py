"""A Hugging Face hub on loopback, for the download path: `HF_ENDPOINT` pointed at it makes
huggingface_hub's own `snapshot_download` fetch from it as from huggingface.co.

It answers the three requests a snapshot download makes, in the hub's own shapes:
- `GET /api/models/{repo}/revision/{rev}`: the repo's commit and its files (`siblings`);
- `GET /api/models/{repo}/tree/{rev}`: each file's path, size and blob id;
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: the file, with `X-Repo-Commit` and `ETag`.
A repo or revision it does not hold is the hub's 404 with its `X-Error-Code`; with `token`
set, a request without `Authorization: Bearer <token>` is the 401 a private repo answers.
Every request is recorded in `requests`, so a test can see what was fetched and with what.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    commit: str
    files: dict[str, bytes]
    refs: tuple[str, ...] = ("main",)

    @classmethod
    def of(cls, folder: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Repo:
        return cls(commit, {p.relative_to(folder).as_posix(): p.read_bytes()
                            for p in sorted(folder.rglob("*")) if p.is_file()}, refs)

    def holds(self, revision: str) -> bool:
        return revision in self.refs or revision == self.commit


@dataclass
class Hub:
    repos: dict[str, Repo]
    token: str | None = None
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Authorization)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Hub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub.answer(self, body=True)

            def do_HEAD(self):
                hub.answer(self, body=False)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        auth = handler.headers.get("Authorization")
        self.requests.append((handler.command, path, auth))
        if self.token is not None and auth != f"Bearer {self.token}":
            return self._error(handler, "RepoNotFound", "Repository not found", 401)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            name, revision, api = "/".join(parts[2:4]), parts[5], parts[4]
        elif len(parts) >= 5 and parts[2] == "resolve":
            name, revision, api = "/".join(parts[:2]), parts[3], "resolve"
        else:
            return self._error(handler, "RepoNotFound", "Repository not found")
        repo = self.repos.get(name)
        if repo is None:
            return self._error(handler, "RepoNotFound", "Repository not found")
        if not repo.holds(revision):
            return self._error(handler, "RevisionNotFound", f"Invalid rev id: {revision}")
        if api == "revision":
            info = {"id": name, "sha": repo.commit, "siblings": [{"rfilename": f} for f in repo.files]}
        elif api == "tree":
            info = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for f, data in repo.files.items()]
        else:
            data = repo.files.get("/".join(parts[4:]))
            if data is None:
                return self._error(handler, "EntryNotFound", "Entry not found")
            return self._send(handler, data, {"X-Repo-Commit": repo.commit,
                                              "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, body)
        self._send(handler, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    @staticmethod
    def _error(handler: BaseHTTPRequestHandler, code: str, text: str, status: int = 404) -> None:
        Hub._send(handler, json.dumps({"error": text}).encode(),
                  {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": text}, True, status)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, data: bytes, headers: dict[str, str], body: bool,
              status: int = 200) -> None:
        handler.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            handler.send_header(k, v)
        handler.end_headers()
        if body:
            handler.wfile.write(data)
