"""A model hub on localhost for tests: one repository served from a folder, every request logged.

Enough of the Hugging Face Hub's HTTP API for ``huggingface_hub`` to fetch
files from it (``HF_ENDPOINT`` pointed at it, Xet off): the revision's
commit, the repository's tree, and each file by its ``resolve`` URL. The
log says which files were asked for, which is what a test of "nothing is
downloaded" checks.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: The one commit the repository has.
COMMIT = "5" * 40


class FakeHub:
    """Serves ``folder`` (its subfolders too) as the repository ``repo`` until ``close()``; ``log`` holds (method, path) of each request."""

    def __init__(self, folder: Path, repo: str) -> None:
        self.folder, self.repo = folder, repo
        self.log: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self, head=False)

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        """The URL ``HF_ENDPOINT`` takes."""
        return f"http://127.0.0.1:{self._server.server_port}"

    def asked_for(self, name: str) -> list[str]:
        """The methods of the requests for file ``name`` of the repository."""
        return [method for method, path in self.log if path.endswith(f"/resolve/{COMMIT}/{name}")]

    def close(self) -> None:
        """Stops serving."""
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, request: BaseHTTPRequestHandler, head: bool) -> None:
        path = request.path.split("?")[0]
        self.log.append((request.command, path))
        # Every file, in subfolders too (a diffusers repository keeps each model in one), by its path in the repository.
        files = sorted(p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file())
        body, headers, code = b"", {}, 404
        if path.startswith(f"/api/models/{self.repo}/revision/"):
            code = 200
            body = json.dumps({"id": self.repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}).encode()
        elif path.startswith(f"/api/models/{self.repo}/tree/"):
            code = 200
            tree = [{"type": "file", "path": f, "size": (self.folder / f).stat().st_size, "oid": _sha1(self.folder / f)} for f in files]
            body = json.dumps(tree).encode()
        elif path.startswith(f"/{self.repo}/resolve/"):
            name = path.split("/resolve/", 1)[1].split("/", 1)[1]
            if name in files:
                code, body = 200, (self.folder / name).read_bytes()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha1(self.folder / name)}"'}
            else:
                headers = {"X-Error-Code": "EntryNotFound"}
        request.send_response(code)
        for key, value in headers.items():
            request.send_header(key, value)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        if not head:
            request.wfile.write(body)


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()
