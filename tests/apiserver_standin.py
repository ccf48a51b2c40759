"""A stand-in for the Kubernetes API server's service proxy, on 127.0.0.1.

Rejects requests without the expected bearer token and forwards
/api/v1/namespaces/<ns>/services/<svc>:<port>/proxy/<rest> to a local Ray dashboard,
the way GKE's API server forwards to the head service.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ServiceProxyStandin:
    def __init__(self, token: str, namespace: str, service: str, port: int, upstream: str):
        self.prefix = f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy"
        self.token, self.upstream = token, upstream.rstrip("/")
        self.requests: list[tuple[str, str, int]] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self):
                if self.headers.get("Authorization") != f"Bearer {standin.token}":
                    return self._reply(401, b'{"kind":"Status","message":"Unauthorized"}', "application/json")
                if not self.path.startswith(standin.prefix + "/"):
                    return self._reply(404, b'{"kind":"Status","message":"not found"}', "application/json")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "authorization", "content-length")
                }
                request = urllib.request.Request(
                    standin.upstream + self.path[len(standin.prefix) :], data=body, headers=headers, method=self.command
                )
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        status, payload, kind = response.status, response.read(), response.headers.get("Content-Type")
                except urllib.error.HTTPError as err:
                    status, payload, kind = err.code, err.read(), err.headers.get("Content-Type")
                standin.requests.append((self.command, self.path, status))
                self._reply(status, payload, kind)

            def _reply(self, status: int, payload: bytes, kind: str | None):
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> ServiceProxyStandin:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
