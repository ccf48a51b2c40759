"""A few authenticated GETs against a GKE API server, with the caller's Google credentials.

Used from dynamic providers at `up` time; nothing here runs during preview or under mocks.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"


def google_access_token() -> str:
    """The caller's Application Default Credentials, as gke-gcloud-auth-plugin would use them."""
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
    credentials.refresh(google.auth.transport.requests.Request())
    return credentials.token


@dataclass(frozen=True)
class KubeApi:
    base_url: str  # https://ENDPOINT, or http://127.0.0.1:PORT for a local stand-in
    token: str
    ca_certificate_b64: str | None = None

    def _context(self) -> ssl.SSLContext | None:
        if not self.base_url.startswith("https://"):
            return None
        if not self.ca_certificate_b64:
            return ssl.create_default_context()
        return ssl.create_default_context(cadata=base64.b64decode(self.ca_certificate_b64).decode())

    def get(self, path: str, timeout: float = 30) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.base_url.rstrip("/") + path,
            headers={"Authorization": f"Bearer {self.token}", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._context()) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            body = err.read()
            try:
                return err.code, json.loads(body or b"{}")
            except ValueError:
                return err.code, {"message": body.decode(errors="replace")}


def for_gke(endpoint: str, ca_certificate_b64: str) -> KubeApi:
    return KubeApi(f"https://{endpoint}", google_access_token(), ca_certificate_b64)
