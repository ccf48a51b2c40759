"""Scales the RayCluster's TPU worker group around the jobs, so the slices bill only while they run.

Plain Kubernetes, through the API server with the caller's Google credentials: a JSON patch of
the group's `replicas` (one a slice; a merge patch would replace the whole workerGroupSpecs list),
then a wait until every host's worker pod of every slice is Ready. GKE adds each slice's nodes for
its pods (each slice's node pool autoscales 0..hosts; on Autopilot the pods alone ask for them) and
removes them once the group is back at 0.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from infra.runner.kube_api import KubeApi

RAYCLUSTER = "/apis/ray.io/v1/namespaces/{namespace}/rayclusters/{name}"
PODS = "/api/v1/namespaces/{namespace}/pods?labelSelector={selector}"
EVENTS = "/api/v1/namespaces/{namespace}/events?fieldSelector={selector}"
# What the scheduler and the cluster autoscaler say about a pod that gets no node.
CAUSE_REASONS = ("NotTriggerScaleUp", "FailedScaleUp", "FailedScheduling", "FailedCreate")


class SliceNotReady(RuntimeError):
    """The slice's hosts did not all become Ready in time (the group is back at 0)."""


class NoRayCluster(RuntimeError):
    """The RayCluster is not there (deleted by hand, or not yet created)."""


def is_ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def is_scheduled(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in conditions)


@dataclass
class SliceScaler:
    api: KubeApi
    namespace: str
    ray_cluster: str
    group: str
    hosts: int  # of every slice together
    ready_timeout_s: float
    poll_s: float = 10
    log: Callable[[str], None] = print
    flex_start: bool = False  # capacity from the Dynamic Workload Scheduler: the wait is for it
    replicas: int = 1  # slices
    up_since: float | None = field(default=None, init=False)  # monotonic time of the scale-up request

    @property
    def _path(self) -> str:
        return RAYCLUSTER.format(namespace=self.namespace, name=self.ray_cluster)

    def _group(self) -> tuple[int, int]:
        """(index of the worker group in workerGroupSpecs, its replicas now)."""
        status, body = self.api.get(self._path)
        if status == 404:
            raise NoRayCluster(f"RayCluster {self.namespace}/{self.ray_cluster} does not exist")
        if status != 200:
            raise RuntimeError(f"RayCluster {self.namespace}/{self.ray_cluster}: HTTP {status}: {body.get('message')}")
        for index, group in enumerate(body.get("spec", {}).get("workerGroupSpecs", [])):
            if group.get("groupName") == self.group:
                return index, int(group.get("replicas", 0))
        raise RuntimeError(f"RayCluster {self.ray_cluster} has no worker group {self.group!r}")

    def set_replicas(self, replicas: int) -> None:
        index, _ = self._group()
        patch = [
            # fails the patch, rather than scaling another group, if the list changed meanwhile
            {"op": "test", "path": f"/spec/workerGroupSpecs/{index}/groupName", "value": self.group},
            {"op": "add", "path": f"/spec/workerGroupSpecs/{index}/replicas", "value": replicas},
        ]
        status, body = self.api.request("PATCH", self._path, patch, content_type="application/json-patch+json")
        if status != 200:
            raise RuntimeError(f"scaling {self.group} to {replicas}: HTTP {status}: {body.get('message')}")

    def up(self) -> None:
        """Ask for every slice (a no-op when they are there) and wait until all their hosts are Ready."""
        _, replicas = self._group()
        if self.up_since is None:
            self.up_since = time.monotonic()
        if replicas < self.replicas:
            slices = f"{self.replicas} slices, " if self.replicas > 1 else ""
            self.log(f"TPU slice: scaling worker group {self.group} to {self.replicas} ({slices}{self.hosts} hosts)")
            self.set_replicas(self.replicas)
        self.wait_ready()

    def pods(self) -> list[dict]:
        selector = urllib.parse.quote(f"ray.io/cluster={self.ray_cluster},ray.io/group={self.group}")
        status, body = self.api.get(PODS.format(namespace=self.namespace, selector=selector))
        if status != 200:
            raise RuntimeError(f"listing the {self.group} pods: HTTP {status}: {body.get('message')}")
        return body.get("items", [])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        shown = None
        while True:
            pods = self.pods()
            ready = sum(is_ready(p) for p in pods)
            if ready >= self.hosts:
                self.log(f"TPU slice: {self.hosts}/{self.hosts} hosts ready")
                return
            adding = "waiting for flex-start capacity" if self.flex_start else "GKE is adding nodes"
            waiting = adding if not all(is_scheduled(p) for p in pods) or not pods else "Ray is starting"
            progress = f"TPU slice: {ready}/{self.hosts} hosts ready ({waiting})"
            if progress != shown:
                self.log(progress)
                shown = progress
            if time.monotonic() >= deadline:
                causes = self.causes(pods)
                self.down()
                raise SliceNotReady(
                    f"the TPU slice ({self.group}: {self.hosts} hosts) was not ready within "
                    f"{self.ready_timeout_s / 60:.0f} min; it is scaled back to 0. {causes}"
                )
            time.sleep(self.poll_s)

    def causes(self, pods: list[dict]) -> str:
        """The scheduler's and the autoscaler's latest words on the pods that got no node."""
        found: dict[str, str] = {}
        for pod in pods:
            if is_ready(pod):
                continue
            name = pod["metadata"]["name"]
            selector = urllib.parse.quote(f"involvedObject.kind=Pod,involvedObject.name={name}")
            status, body = self.api.get(EVENTS.format(namespace=self.namespace, selector=selector))
            for event in body.get("items", []) if status == 200 else []:
                if event.get("reason") in CAUSE_REASONS:
                    found[event["reason"]] = event.get("message", "")
        if not found:
            return "No scheduling events were found; see `kubectl get events` in the namespace."
        said = "; ".join(f"{reason}: {message}" for reason, message in found.items())
        return (
            f"Likely cause, from the pods' events: {said}. A TPU quota too small for the slice, no "
            "capacity in the zone (stockout; Spot makes it likelier), or a reservation that does not "
            "match the machine type and topology all read like this."
        )

    def down(self) -> float:
        """Scale the group to 0; returns the host-hours since the scale-up request."""
        self.log(f"TPU slice: scaling worker group {self.group} to 0; GKE removes its nodes once they are idle")
        self.set_replicas(0)
        hours = (time.monotonic() - self.up_since) / 3600 if self.up_since is not None else 0.0
        self.up_since = None
        return self.hosts * hours
