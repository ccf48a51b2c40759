"""The CRD wait, against a stand-in API server that installs the CRD after a few polls."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.crd_wait import CRD_PATH, wait_for_crd
from infra.runner.kube_api import KubeApi
from infra.runner.resilience import FixedToken, RetryPolicy


def serve(responses: list[tuple[int, dict]]):
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            status, body = responses[min(len(seen), len(responses)) - 1]
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


ESTABLISHED = {
    "status": {"conditions": [{"type": "NamesAccepted", "status": "True"}, {"type": "Established", "status": "True"}]}
}
PENDING = {"status": {"conditions": [{"type": "Established", "status": "False"}]}}


def test_waits_through_missing_and_pending_until_established():
    server, seen = serve([(404, {}), (404, {}), (200, PENDING), (200, ESTABLISHED)])
    api = KubeApi(f"http://127.0.0.1:{server.server_address[1]}", FixedToken("tok"))
    messages = []
    crd = wait_for_crd(api, "rayclusters.ray.io", timeout_s=10, poll_s=0.01, log=lambda m, **_: messages.append(m))
    server.shutdown()
    assert crd == ESTABLISHED and len(seen) == 4
    assert seen[0] == (CRD_PATH + "rayclusters.ray.io", "Bearer tok")
    assert messages == [
        "CRD rayclusters.ray.io: not installed yet; waiting",
        "CRD rayclusters.ray.io: not established yet; waiting",
    ]


def test_times_out_naming_the_crd_and_the_fix():
    server, _ = serve([(404, {})])
    api = KubeApi(f"http://127.0.0.1:{server.server_address[1]}", FixedToken("tok"))
    with pytest.raises(TimeoutError, match="rayclusters.ray.io was not established.*Ray Operator add-on"):
        wait_for_crd(api, "rayclusters.ray.io", timeout_s=0.05, poll_s=0.01, log=lambda *a, **k: None)
    server.shutdown()


def test_transient_errors_are_retried_not_reported():
    """A 503 and a 502 from a control plane under repair are ridden out; the 404s are answers."""
    server, seen = serve([(503, {}), (404, {}), (502, {}), (200, ESTABLISHED)])
    api = KubeApi(
        f"http://127.0.0.1:{server.server_address[1]}",
        FixedToken("tok"),
        policy=RetryPolicy(budget_s=5, base_s=0.01),
        log=lambda _: None,
    )
    messages = []
    crd = wait_for_crd(api, "rayclusters.ray.io", timeout_s=10, poll_s=0.01, log=lambda m, **_: messages.append(m))
    server.shutdown()
    assert crd == ESTABLISHED and len(seen) == 4
    assert messages == ["CRD rayclusters.ray.io: not installed yet; waiting"]  # no "HTTP 503" state shown
