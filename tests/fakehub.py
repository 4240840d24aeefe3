"""A Hugging Face Hub stand-in on loopback, for huggingface_hub pointed at it (HF_ENDPOINT).

No test can reach huggingface.co, so this answers the few routes huggingface_hub's download path takes,
as the Hub answers them (huggingface_hub's own error mapping, `utils/_http.py::hf_raise_for_status`, reads
the same status codes and `X-Error-Code` headers):
- GET  /api/models/ORG/NAME[/revision/REV]   the repository's info (sha, siblings; `gated`);
- GET  /api/models/ORG/NAME/tree/REV?recursive=True   every file (type, path, size, oid);
- HEAD / GET /ORG/NAME/resolve/REV/PATH    a file: X-Repo-Commit, ETag (its git blob id), Content-Length;
and the errors: an unknown repository 404 `RepoNotFound`, an unknown revision 404 `RevisionNotFound`, a
missing file 404 `EntryNotFound`, a gated repository's files without a token 401 `GatedRepo` (its info
and listing stay public, as on the Hub). Every request is counted (`FakeHub.requests`), and by the client
process's name (`FakeHub.by_origin`: huggingface_hub's HF_HUB_USER_AGENT_ORIGIN, in its User-Agent);
`delays` slows a file's download (seconds), so that processes overlap.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_oid(data: bytes) -> str:
    """A file's git blob id, as the Hub names a non-LFS file (and huggingface_hub its cache blob)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """commits: commit id (40 hex digits) -> {path: content}; refs: branch or tag -> commit id."""

    commits: dict[str, dict[str, bytes]]
    refs: dict[str, str]
    gated: bool = False

    def commit(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


@dataclass
class FakeHub:
    repos: dict[str, Repo]
    delays: dict[str, float] = field(default_factory=dict)  # file path -> seconds before its GET answers
    requests: Counter = field(default_factory=Counter)  # (method, route kind, repo, path) -> count
    by_origin: Counter = field(default_factory=Counter)  # (origin, method, route kind, path) -> count

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                hub.answer(self, body=True)

            def do_HEAD(self):
                hub.answer(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def _send(h, status: int, headers: dict, payload: bytes, body: bool) -> None:
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(payload))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(payload)

    def _error(self, h, status: int, code: str, message: str, body: bool) -> None:
        self._send(h, status, {"X-Error-Code": code, "X-Error-Message": message,
                               "Content-Type": "application/json"}, json.dumps({"error": message}).encode(), body)

    def answer(self, h, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(h.path).path.split("/")[1:]]
        api = parts[:2] == ["api", "models"]
        if api:
            parts = parts[2:]
            if len(parts) == 2:  # /api/models/ORG/NAME: the default branch's info
                parts += ["revision", "main"]
        if len(parts) < 4:
            return self._error(h, 404, "RepoNotFound", "Repository not found", body)
        repo_id, kind, rev, rest = "/".join(parts[:2]), parts[2], parts[3], "/".join(parts[4:])
        self.requests[(h.command, kind, repo_id, rest)] += 1
        origin = re.search(r"origin/(\S+)", h.headers.get("User-Agent", ""))
        self.by_origin[(origin[1] if origin else "", h.command, kind, rest)] += 1
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404 if api else 401, "RepoNotFound", "Repository not found", body)
        commit = repo.commit(rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
        files = repo.commits[commit]
        if api and kind == "revision":
            info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                    "gated": "manual" if repo.gated else False, "siblings": [{"rfilename": p} for p in sorted(files)]}
            return self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(info).encode(), body)
        if api and kind == "tree":
            tree = [{"type": "file", "path": p, "size": len(d), "oid": git_oid(d)} for p, d in sorted(files.items())]
            return self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(tree).encode(), body)
        if not api and kind == "resolve":
            if repo.gated and not h.headers.get("Authorization"):
                return self._error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                   "access to it and be authenticated to access it. Please log in.", body)
            if rest not in files:
                return self._send(h, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit,
                                           "X-Error-Message": "Entry not found"}, b"Entry not found", body)
            data = files[rest]
            if body and rest in self.delays:
                time.sleep(self.delays[rest])
            return self._send(h, 200, {"X-Repo-Commit": commit, "ETag": f'"{git_oid(data)}"',
                                       "Content-Type": "application/octet-stream"}, data, body)
        return self._error(h, 404, "RepoNotFound", "Repository not found", body)
