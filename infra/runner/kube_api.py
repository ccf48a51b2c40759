"""A few authenticated calls to a GKE API server, with the caller's Google credentials.

Used from dynamic providers at `up` time; nothing here runs during preview or under mocks.
Every call refreshes the token when needed and retries what is transient (infra/runner/resilience.py).
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from infra.runner.resilience import GoogleTokens, RetryPolicy, TokenSource, call_with_retries

RERUN_HINT = (
    "Nothing was lost: a job already started keeps running on the cluster, and `pulumi up` again "
    "re-attaches to it once the API server answers."
)


@dataclass(frozen=True)
class KubeApi:
    base_url: str  # https://ENDPOINT, or http://127.0.0.1:PORT for a local stand-in
    tokens: TokenSource
    ca_certificate_b64: str | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    log: Callable[[str], None] = print

    def _context(self) -> ssl.SSLContext | None:
        if not self.base_url.startswith("https://"):
            return None
        if not self.ca_certificate_b64:
            return ssl.create_default_context()
        return ssl.create_default_context(cadata=base64.b64decode(self.ca_certificate_b64).decode())

    def _send(self, method: str, path: str, body: bytes | None, content_type: str | None, token: str, timeout: float):
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self.base_url.rstrip("/") + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._context()) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            payload = err.read()
            try:
                return err.code, json.loads(payload or b"{}")
            except ValueError:
                return err.code, {"message": payload.decode(errors="replace")}

    def request(
        self, method: str, path: str, body: object = None, content_type: str | None = None, timeout: float = 30
    ) -> tuple[int, dict]:
        """One call, with fresh credentials and retries; returns (status, parsed JSON body)."""
        data = json.dumps(body).encode() if body is not None else None
        return call_with_retries(
            lambda token: self._send(method, path, data, content_type, token, timeout),
            self.tokens,
            self.policy,
            what=f"{method} {self.base_url}{path}",
            hint=RERUN_HINT,
            log=self.log,
        )

    def get(self, path: str, timeout: float = 30) -> tuple[int, dict]:
        return self.request("GET", path, timeout=timeout)


def api_server_url(endpoint: str) -> str:
    """GKE gives the endpoint as a bare address; a local stand-in's comes with its scheme."""
    return endpoint if "://" in endpoint else f"https://{endpoint}"


def for_gke(endpoint: str, ca_certificate_b64: str) -> KubeApi:
    return KubeApi(api_server_url(endpoint), GoogleTokens(), ca_certificate_b64)
