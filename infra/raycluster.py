"""The KubeRay RayCluster for the TPU slices, its token Secret, and the wait for its CRD."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import pulumi
import pulumi_kubernetes as k8s

from infra import PROJECT, ROOT
from infra.capacity import HEAD_RESOURCES, SliceCapacity
from infra.crd_wait import CrdEstablished
from infra.stop_hook import command as stop_hook
from infra.tpu import TpuSlice

RAYCLUSTER_CRD = "rayclusters.ray.io"
API_VERSION, KIND = "ray.io/v1", "RayCluster"
TOKEN_SECRET = "hf-secret"
TOKEN_KEY = "hf_api_token"
DASHBOARD_PORT = 8265
HEAD_PORTS = (("gcs", 6379), ("dashboard", DASHBOARD_PORT), ("client", 10001))
# A TPU worker pod's termination: the preStop hook (infra/stop_hook.py) waits up to STOP_WAIT_S for the
# training workers' save, inside the pod's grace period. 120 s is also the most GKE gives a Spot node's
# pods once its graceful shutdown is extended (15 s by default: docs.cloud.google.com/kubernetes-engine/
# docs/concepts/spot-vms, "Termination and graceful shutdown of Spot VMs").
STOP_WAIT_S, TERMINATION_GRACE_S = 110, 120
IMAGE_REQUIREMENTS = ROOT / "image" / "requirements.txt"
# TorchTPU's tier-3 compile cache root: the name torch_tpu's env_vars.h reads
# (kTorchTpuInternalTier3CompilationCacheRootEnvVar), and the public name its newer cache tests and
# scripts use; each release reads one of them. A gs:// root is shared by every host and outlives pods.
COMPILE_CACHE_VARS = ("TORCH_TPU_INTERNAL_TIER3_COMPILATION_CACHE_ROOT", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT")


@dataclass(frozen=True)
class RayClusterArgs:
    name: str  # a DNS-1035 label: the TPU webhook builds the worker hostnames from it
    namespace: str
    tpu: TpuSlice
    capacity: SliceCapacity
    autopilot: bool
    head_cpus: int  # what Ray may schedule on the head: the data preparation (0: the walkthrough's head)
    num_slices: int = 1  # replicas of the TPU worker group: one multi-host slice each
    defer_and_fuse: bool = False  # TORCH_TPU_DEFER_AND_FUSE=1 on the TPU workers
    compile_cache: str = ""  # TorchTPU's tier-3 cache root ("" none: only its in-pod /dev/shm cache)


@cache
def ray_version(requirements=IMAGE_REQUIREMENTS) -> str:
    """The Ray the image installs (its pin in image/requirements.txt), which KubeRay is told as rayVersion."""
    found = re.search(r"^ray\[[a-z,]+\]==(\S+)$", requirements.read_text(), re.MULTILINE)
    if found is None:
        raise ValueError(f"{requirements} pins no ray[...]==VERSION")
    return found.group(1)


def head_service(ray_cluster_name: str) -> str:
    return f"{ray_cluster_name}-head-svc"


def dashboard_command(namespace: str, ray_cluster_name: str) -> str:
    return f"kubectl -n {namespace} port-forward svc/{head_service(ray_cluster_name)} {DASHBOARD_PORT}:{DASHBOARD_PORT}"


def _token_env() -> dict:
    return {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET, "key": TOKEN_KEY}}}


def _autopilot_selectors(capacity: SliceCapacity) -> dict[str, str]:
    """Autopilot has no node pools: Spot, flex-start and reservations are asked for by the pods."""
    if capacity.spot:
        return {"cloud.google.com/gke-spot": "true"}
    if capacity.flex_start:  # GKE's documented pod selector for flex-start capacity
        return {"cloud.google.com/gke-flex-start": "true"}
    if capacity.reservation:
        selectors = {
            "cloud.google.com/reservation-name": capacity.reservation_name,
            "cloud.google.com/reservation-affinity": "specific",
        }
        if capacity.reservation_project:
            selectors["cloud.google.com/reservation-project"] = capacity.reservation_project
        return selectors
    return {}


def worker_replicas(capacity: SliceCapacity, num_slices: int = 1) -> dict:
    """Every slice always (the walkthrough's one), or none until the job resource asks for them: a
    replica of the group is one multi-host slice of `numOfHosts` pods (KubeRay).

    With scaleToZero, `replicas` is left out: the CRD defaults it to 0 when the RayCluster is
    created, and since Pulumi never declares it, no later `up` sets it back under a running job
    (the job resource patches it to num_slices and back to 0).
    """
    if not capacity.scale_to_zero:
        return {"replicas": num_slices}
    return {"minReplicas": 0, "maxReplicas": num_slices}


def torch_tpu_env(cluster: RayClusterArgs) -> list[dict]:
    """TorchTPU's switches on the TPU workers (never on the head, nor on the CPU path, which has no RayCluster)."""
    env = [{"name": "TORCH_TPU_DEFER_AND_FUSE", "value": "1"}] if cluster.defer_and_fuse else []
    return env + [
        {"name": name, "value": cluster.compile_cache} for name in COMPILE_CACHE_VARS if cluster.compile_cache
    ]


def ray_cluster_manifest(cluster: RayClusterArgs, image: str) -> dict:
    """The RayCluster as a plain dict: one CPU head, one worker group of a replica per slice."""
    tpu = cluster.tpu
    env = [_token_env(), *tpu.ray_env]
    selectors = tpu.node_selector | (_autopilot_selectors(cluster.capacity) if cluster.autopilot else {})
    worker_group = {
        "groupName": tpu.worker_group,
        **worker_replicas(cluster.capacity, cluster.num_slices),
        "numOfHosts": tpu.hosts,
        "rayStartParams": {},
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": image,
                        "env": env + torch_tpu_env(cluster),
                        "resources": {"requests": tpu.worker_resources, "limits": tpu.worker_resources},
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                        "lifecycle": {"preStop": {"exec": {"command": stop_hook(STOP_WAIT_S)}}},
                    }
                ],
                "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
                "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": tpu.shm_size}}],
                "nodeSelector": selectors,
            }
        },
    }
    if tpu.ray_resources:
        worker_group["resources"] = tpu.ray_resources
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": cluster.name, "namespace": cluster.namespace},
        "spec": {
            "rayVersion": ray_version(),
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": str(cluster.head_cpus)},
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": image,
                                "ports": [{"containerPort": port, "name": name} for name, port in HEAD_PORTS],
                                "env": env,
                                "resources": {"requests": HEAD_RESOURCES, "limits": HEAD_RESOURCES},
                            }
                        ]
                    }
                },
            },
            "workerGroupSpecs": [worker_group],
        },
    }


class RayCluster(pulumi.ComponentResource):
    """Secret, CRD wait and RayCluster; done only when the head pod is ready."""

    def __init__(
        self,
        cluster: RayClusterArgs,
        image: pulumi.Input[str],
        hf_token: pulumi.Input[str],
        provider: k8s.Provider,
        endpoint: pulumi.Input[str],
        ca_certificate: pulumi.Input[str],
        depends_on: list[pulumi.Resource] = (),
        opts: pulumi.ResourceOptions | None = None,
    ):
        name = cluster.name
        super().__init__(f"{PROJECT}:infra:RayCluster", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=provider)
        self.secret = k8s.core.v1.Secret(
            f"{name}-hf-token",
            metadata={"name": TOKEN_SECRET, "namespace": cluster.namespace},
            type="Opaque",
            string_data={TOKEN_KEY: pulumi.Output.secret(hf_token)},
            opts=k8s_opts,
        )
        self.crd = CrdEstablished(
            f"{name}-crd",
            endpoint=endpoint,
            ca_certificate=ca_certificate,
            crd=RAYCLUSTER_CRD,
            opts=pulumi.ResourceOptions(parent=self),
        )
        spec = pulumi.Output.from_input(image).apply(lambda ref: ray_cluster_manifest(cluster, ref)["spec"])
        self.ray_cluster = k8s.apiextensions.CustomResource(
            name,
            api_version=API_VERSION,
            kind=KIND,
            metadata={
                "name": cluster.name,
                "namespace": cluster.namespace,
                # The provider's await: `up` moves on only once KubeRay reports the head ready.
                "annotations": {"pulumi.com/waitFor": "condition=HeadPodReady"},
            },
            spec=spec,
            opts=k8s_opts.merge(
                pulumi.ResourceOptions(
                    depends_on=[self.crd, self.secret, *depends_on],
                    custom_timeouts=pulumi.CustomTimeouts(create="60m", update="60m"),
                )
            ),
        )
        self.name = self.ray_cluster.metadata["name"]
        self.register_outputs({"name": self.name})
