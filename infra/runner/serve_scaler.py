"""Scales the RayService's replicas down after an endpoint that never answered, and back for the next `up`.

With `serveMinReplicas` above 0, Ray Serve keeps a replica, and so a TPU host, however long it fails to start. When
`up`'s scoring job finds the endpoint never answered, this sets every deployment's `min_replicas` to 0 in the
RayService's serveConfigV2 (a JSON patch through the API server, with the caller's Google credentials). KubeRay
applies a serveConfigV2 change to the running cluster in place (no new RayCluster: KubeRay's RayService guide,
"In-place updates for Ray Serve applications"); Serve then retires the replica, Ray's autoscaler the idle pod and
GKE's the node. The next `up` puts the declared serveConfigV2 back before it waits again (Pulumi's state still
holds the declared one, so Pulumi alone would not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import yaml

from infra.runner.kube_api import KubeApi

RAYSERVICE = "/apis/ray.io/v1/namespaces/{namespace}/rayservices/{name}"


def without_minimum(serve_config_v2: str) -> str:
    """The same Serve config with every LLM deployment's autoscaling minimum at 0."""
    config = yaml.safe_load(serve_config_v2)
    for application in config["applications"]:
        for llm in application.get("args", {}).get("llm_configs", []):
            scaling = llm.setdefault("deployment_config", {}).setdefault("autoscaling_config", {})
            scaling["min_replicas"] = 0
    return yaml.safe_dump(config, sort_keys=False)


@dataclass
class ServeScaler:
    api: KubeApi
    namespace: str
    ray_service: str
    declared: str  # the serveConfigV2 the program declares
    log: Callable[[str], None] = print

    @property
    def _path(self) -> str:
        return RAYSERVICE.format(namespace=self.namespace, name=self.ray_service)

    def live(self) -> str:
        status, body = self.api.get(self._path)
        if status != 200:
            raise RuntimeError(f"RayService {self.namespace}/{self.ray_service}: HTTP {status}: {body.get('message')}")
        return body.get("spec", {}).get("serveConfigV2", "")

    def _set(self, serve_config_v2: str) -> None:
        patch = [{"op": "replace", "path": "/spec/serveConfigV2", "value": serve_config_v2}]
        status, body = self.api.request("PATCH", self._path, patch, content_type="application/json-patch+json")
        if status != 200:
            raise RuntimeError(
                f"RayService {self.namespace}/{self.ray_service}: patching serveConfigV2: HTTP {status}: "
                f"{body.get('message')}"
            )

    def put_back(self) -> None:
        """The declared serveConfigV2, if a failed `up` left the minimum at 0."""
        if self.live() != self.declared:
            self.log(f"serving: RayService {self.ray_service}'s serveConfigV2 put back as declared (an earlier "
                     "`up` had set its minimum replicas to 0 after the endpoint never answered)")  # fmt: skip
            self._set(self.declared)

    def to_zero(self) -> None:
        """Every deployment's minimum at 0: nothing keeps a TPU host for a replica that does not start."""
        self._set(without_minimum(self.declared))
        self.log(f"serving: the endpoint never answered; RayService {self.ray_service}'s minimum replicas set to 0, "
                 "so Serve retires the replica and the autoscalers its TPU host (about 20 minutes); the next "
                 "`pulumi up` puts serveMinReplicas back")  # fmt: skip
