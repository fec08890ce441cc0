"""A local HTTP server that speaks the part of the Hugging Face Hub's API that ``huggingface_hub``'s
``hf_hub_download`` and ``snapshot_download`` use, so the real client can be tested with
``HF_ENDPOINT=http://127.0.0.1:PORT`` on a machine without internet:

- ``GET /api/models/ORG/NAME[/revision/REV]``: repository info (``sha`` = the commit, ``siblings``);
- ``GET /api/models/ORG/NAME/tree/REV[/PATH]``: the file listing (``oid``, ``size``, ``lfs``);
- ``HEAD`` / ``GET /ORG/NAME/resolve/REV/PATH``: a file, with the hub's ``X-Repo-Commit``,
  ``ETag`` / ``X-Linked-Etag`` (the sha256 of LFS files) and ``X-Linked-Size`` headers.

Errors carry the hub's ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``, ``GatedRepo``), which ``huggingface_hub`` turns into its typed errors; a
repository with a ``token`` answers 401 to requests without ``Authorization: Bearer TOKEN``.
Every request is recorded in :attr:`FakeHub.requests` as ``(method, path)``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the hub reports as a file's ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """A model repository: ``files`` (path -> bytes) at one commit, reachable as ``main`` and
    by the commit hash; ``token`` makes it private, ``gated`` refuses every download,
    ``delay_s`` holds each file's GET that long before answering (a download in flight)."""

    files: dict[str, bytes]
    token: str | None = None
    gated: bool = False
    delay_s: float = 0.0
    commit: str = field(default="")

    def __post_init__(self) -> None:
        if not self.commit:
            h = hashlib.sha1()
            for path in sorted(self.files):
                h.update(path.encode() + b"\0" + self.files[path])
            self.commit = h.hexdigest()


class FakeHub:
    """A threaded HTTP server holding ``repos`` (``"org/name" -> Repo``); a context manager.

    Attributes:
        url: ``http://127.0.0.1:PORT`` (the value for ``HF_ENDPOINT``).
        requests: ``(method, path)`` of every request to the model API and files, in order.
    """

    LFS_THRESHOLD = 1024  # files at least this large are "LFS" (sha256 ETags), as on the hub

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

            def do_GET(self) -> None:
                hub._handle(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ routing

    def _find_repo(self, parts: list[str]) -> tuple[str, Repo | None, list[str]]:
        repo_id = "/".join(parts[:2])
        return repo_id, self.repos.get(repo_id), parts[2:]

    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = urlsplit(h.path).path
        if path != "/api/agent-harnesses":  # huggingface_hub's once-a-day telemetry look-up
            self.requests.append((h.command, path))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"]:
            repo_id, repo, rest = self._find_repo(parts[2:])
            if (err := self._check(h, repo)) is not None:
                return self._error(h, *err)
            assert repo is not None
            if not rest or rest[0] == "revision":
                rev = rest[1] if len(rest) > 1 else "main"
                if rev not in ("main", repo.commit):
                    return self._error(h, 404, "RevisionNotFound")
                return self._json(h, {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": bool(
                    repo.token), "gated": repo.gated, "siblings": [{"rfilename": p} for p in sorted(repo.files)]},
                    body)
            if rest[0] == "tree" and len(rest) >= 2:
                if rest[1] not in ("main", repo.commit):
                    return self._error(h, 404, "RevisionNotFound")
                prefix = "/".join(rest[2:])
                entries = [self._entry(p, d) for p, d in sorted(repo.files.items())
                           if not prefix or p.startswith(prefix.rstrip("/") + "/")]
                return self._json(h, entries, body)
            return self._error(h, 404, None)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, repo, rest = self._find_repo(parts)
            if (err := self._check(h, repo)) is not None:
                return self._error(h, *err)
            assert repo is not None
            rev, file = rest[1], "/".join(rest[2:])
            if rev not in ("main", repo.commit):
                return self._error(h, 404, "RevisionNotFound")
            if repo.gated:
                return self._error(h, 403, "GatedRepo")
            if file not in repo.files:
                return self._error(h, 404, "EntryNotFound", {"X-Repo-Commit": repo.commit})
            return self._file(h, repo, file, body)
        return self._error(h, 404, None)

    def _check(self, h: BaseHTTPRequestHandler, repo: Repo | None) -> tuple[int, str] | None:
        if repo is None:
            return 404, "RepoNotFound"
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            return 401, "RepoNotFound"  # the hub hides private repositories behind 401
        return None

    def _entry(self, path: str, data: bytes) -> dict:
        e = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
        if len(data) >= self.LFS_THRESHOLD:
            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return e

    # ------------------------------------------------------------------ responses

    def _json(self, h: BaseHTTPRequestHandler, obj: object, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _file(self, h: BaseHTTPRequestHandler, repo: Repo, file: str, body: bool) -> None:
        data = repo.files[file]
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng[6:].rstrip("-").isdigit():
            start = int(rng[6:].rstrip("-"))
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", repo.commit)
        if len(data) >= self.LFS_THRESHOLD:
            sha = hashlib.sha256(data).hexdigest()
            h.send_header("ETag", f'"{sha}"')
            h.send_header("X-Linked-Etag", f'"{sha}"')
            h.send_header("X-Linked-Size", str(len(data)))
        else:
            h.send_header("ETag", f'"{git_blob_sha1(data)}"')
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if body:
            time.sleep(repo.delay_s)
            h.wfile.write(data[start:])

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str | None,
               extra: dict[str, str] | None = None) -> None:
        data = json.dumps({"error": code or "Not Found"}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
            h.send_header("X-Error-Message", code)
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
