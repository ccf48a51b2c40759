"""A stand-in for the Kubernetes API server's service proxy, on 127.0.0.1.

Rejects requests without an accepted bearer token (401) and forwards
/api/v1/namespaces/<ns>/services/<svc>:<port>/proxy/<rest> to a local Ray dashboard,
the way GKE's API server forwards to the head service. For the failure tests it can also
refuse everything (403), be down (503 to all), answer a seeded share of requests with 503 or
a dropped connection, and drop the response to the first job submit after forwarding it.

With a `FakeSlice`, it also serves the RayCluster (GET, JSON PATCH of a worker group's
replicas), the group's pods and their events, as the API server would for KubeRay and GKE; with a
`FakeRayService`, a RayService (GET, JSON PATCH of its serveConfigV2).
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ServiceProxyStandin:
    def __init__(
        self,
        token: str | Callable[[str], bool],
        namespace: str,
        service: str,
        port: int,
        upstream: str,
        *,
        mode: str = "ok",  # ok | forbidden | down
        fault_share: float = 0.0,
        max_faults: int = 0,
        seed: int = 0,
        drop_first_submit: bool = False,
        fake_slice: FakeSlice | None = None,
        fake_service: FakeRayService | None = None,
    ):
        self.prefix = f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy"
        self.accepts = token if callable(token) else (lambda t: t == token)
        self.upstream = upstream.rstrip("/")
        self.mode, self.fault_share, self.faults_left = mode, fault_share, max_faults
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.drop_submit = drop_first_submit
        self.objects = [fake for fake in (fake_slice, fake_service) if fake is not None]  # what it serves itself
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status) of forwarded requests
        self.refused: list[tuple[str, str, int]] = []  # what got 401/403/503 or a dropped connection (status 0)
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = standin._fault(self.command, self.path, self.headers.get("Authorization", ""))
                if fault == "drop":
                    return self._drop()
                if fault:
                    status, message = fault
                    return self._reply(status, b'{"kind":"Status","message":"%s"}' % message, "application/json")
                for fake in standin.objects if not self.path.startswith(standin.prefix + "/") else ():
                    answer = fake.handle(self.command, self.path, body)
                    if answer:
                        return self._reply(answer[0], json.dumps(answer[1]).encode(), "application/json")
                if not self.path.startswith(standin.prefix + "/"):
                    return self._reply(404, b'{"kind":"Status","message":"not found"}', "application/json")
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
                if standin._take_submit_drop(self.command, self.path):
                    return self._drop()  # the job went in; its answer never comes back
                self._reply(status, payload, kind)

            def _drop(self):
                self.close_connection = True
                self.connection.close()

            def _reply(self, status: int, payload: bytes, kind: str | None):
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _fault(self, method: str, path: str, authorization: str):
        """What goes wrong with this request: None, a (status, message), or "drop"."""
        with self.lock:
            fault = None
            if self.mode == "down":
                fault = (503, b"the API server is unavailable")
            elif not self.accepts(authorization.removeprefix("Bearer ")):
                fault = (401, b"Unauthorized")
            elif self.mode == "forbidden":
                fault = (403, b"services proxy is forbidden for this identity")
            elif self.faults_left > 0 and self.rng.random() < self.fault_share:
                self.faults_left -= 1
                fault = "drop" if self.rng.random() < 0.5 else (503, b"upstream connect error")
            if fault:
                self.refused.append((method, path, 0 if fault == "drop" else fault[0]))
            return fault

    def _take_submit_drop(self, method: str, path: str) -> bool:
        with self.lock:
            if self.drop_submit and method == "POST" and path.rstrip("/").endswith("/api/jobs"):
                self.drop_submit = False
                self.refused.append((method, path, 0))
                return True
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> ServiceProxyStandin:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeSlice:
    """A RayCluster's TPU worker group and its pods, as KubeRay and GKE would show them.

    After a scale up, each listing of the pods finds one more host Ready (GKE adding the
    nodes, Ray starting) until every host of every replica (slice) is; with `never_ready`, the pods
    stay Pending, and their events say why, as the scheduler and the cluster autoscaler do on a
    quota or stockout. `hosts` is a slice's.
    """

    def __init__(self, ray_cluster: str, group: str, hosts: int, namespace: str = "default", never_ready=False):
        self.ray_cluster, self.group, self.hosts, self.namespace = ray_cluster, group, hosts, namespace
        self.never_ready, self.replicas, self.ready = never_ready, 0, 0
        self.patches: list[int] = []  # every replicas value patched in, in order
        self.lock = threading.Lock()

    def handle(self, method: str, path: str, body: bytes | None):
        url = urllib.parse.urlsplit(path)
        with self.lock:
            if url.path == f"/apis/ray.io/v1/namespaces/{self.namespace}/rayclusters/{self.ray_cluster}":
                if method == "PATCH":
                    return self._patch(json.loads(body))
                return 200, self._raycluster()
            if url.path == f"/api/v1/namespaces/{self.namespace}/pods":
                return 200, {"items": self._pods()}
            if url.path == f"/api/v1/namespaces/{self.namespace}/events":
                return 200, {"items": self._events()}
        return None

    def _raycluster(self) -> dict:
        head = {"groupName": "headgroup"}
        return {
            "spec": {
                "workerGroupSpecs": [{"groupName": "other"}, {"groupName": self.group, "replicas": self.replicas}],
                "headGroupSpec": head,
            }
        }

    def _patch(self, ops: list[dict]):
        spec = self._raycluster()["spec"]["workerGroupSpecs"]
        for op in ops:
            index = int(op["path"].split("/")[3])
            if op["op"] == "test" and spec[index].get("groupName") != op["value"]:
                return 422, {"kind": "Status", "message": "test operation failed"}
            if op["op"] == "add" and op["path"].endswith("/replicas"):
                if index != 1:
                    return 422, {"kind": "Status", "message": f"patched group {index}, not {self.group}"}
                self.replicas = op["value"]
                self.patches.append(op["value"])
                self.ready = 0
        return 200, self._raycluster()

    def _pods(self) -> list[dict]:
        pods = self.replicas * self.hosts
        if not self.never_ready:
            self.ready = min(pods, self.ready + 1)
        return [
            {
                "metadata": {"name": f"{self.group}-{i // self.hosts}-{i % self.hosts}"},  # (the TPU webhook's names)
                "status": {
                    "conditions": [
                        {"type": "PodScheduled", "status": "True" if i < self.ready else "False"},
                        {"type": "Ready", "status": "True" if i < self.ready else "False"},
                    ]
                },
            }
            for i in range(pods)
        ]

    def _events(self) -> list[dict]:
        return [
            {"reason": "FailedScheduling", "message": "0/3 nodes are available: 3 Insufficient google.com/tpu."},
            {
                "reason": "NotTriggerScaleUp",
                "message": "pod didn't trigger scale-up: 1 in backoff after failed scale-up (GCE quota exceeded)",
            },
        ]


class FakeRayService:
    """A RayService as the API server keeps it: its spec.serveConfigV2, read and replaced by JSON patch."""

    def __init__(self, name: str, serve_config: str, namespace: str = "default"):
        self.path = f"/apis/ray.io/v1/namespaces/{namespace}/rayservices/{name}"
        self.serve_config = serve_config
        self.patches: list[str] = []  # every serveConfigV2 patched in, in order

    def handle(self, method: str, path: str, body: bytes | None):
        if urllib.parse.urlsplit(path).path != self.path:
            return None
        if method == "PATCH":
            for op in json.loads(body):
                if (op["op"], op["path"]) != ("replace", "/spec/serveConfigV2"):
                    return 422, {"kind": "Status", "message": f"unexpected patch {op}"}
                self.serve_config = op["value"]
                self.patches.append(op["value"])
        return 200, {"spec": {"serveConfigV2": self.serve_config}}
