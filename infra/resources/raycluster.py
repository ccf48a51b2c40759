"""The KubeRay RayCluster for the TPU slices, its token Secret, and the wait for its CRD."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import pulumi
import pulumi_kubernetes as k8s

from infra import PROJECT, ROOT
from infra.cloud.capacity import HEAD_RESOURCES, RAY_SHUTDOWN_DRAIN_S, SliceCapacity
from infra.cloud.tpu import TpuSlice
from infra.crd_wait import CrdEstablished
from infra.resources.stop_hook import command as stop_hook

RAYCLUSTER_CRD = "rayclusters.ray.io"
API_VERSION, KIND = "ray.io/v1", "RayCluster"
TOKEN_SECRET = "hf-secret"
TOKEN_KEY = "hf_api_token"
DASHBOARD_PORT = 8265
HEAD_PORTS = (("gcs", 6379), ("dashboard", DASHBOARD_PORT), ("client", 10001))
IMAGE_REQUIREMENTS = ROOT / "image" / "requirements.txt"
# TorchTPU's tier-3 compile cache root: the one name the torch-tpu 0.2.0 wheel's libraries read
# (kTorchTpuTier3CompilationCacheRootEnvVar, in torch_tpu/csrc/common/glue_*/libpywrap_*_common.so). A
# gs:// root is shared by every host and outlives pods.
COMPILE_CACHE_VAR = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"


@dataclass(frozen=True, kw_only=True)
class RayClusterSpec:
    """What the RayCluster's manifest is made of."""

    name: str  # a DNS-1035 label: the TPU webhook builds the worker hostnames from it
    namespace: str
    tpu: TpuSlice
    capacity: SliceCapacity
    autopilot: bool
    head_cpus: int  # what Ray may schedule on the head: the data preparation (0: the walkthrough's head)
    num_slices: int = 1  # replicas of the TPU worker group: one multi-host slice each
    defer_and_fuse: bool = False  # TORCH_TPU_DEFER_AND_FUSE=1 on the TPU workers
    compile_cache: str = ""  # TorchTPU's tier-3 cache root ("" none: only its in-pod /dev/shm cache)
    service_account: str = "default"  # the Kubernetes ServiceAccount every pod runs as (the bucket's grantee)


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


def torch_tpu_env(cluster: RayClusterSpec) -> list[dict]:
    """TorchTPU's switches on the TPU workers (never on the head, nor on the CPU path, which has no RayCluster)."""
    env = [{"name": "TORCH_TPU_DEFER_AND_FUSE", "value": "1"}] if cluster.defer_and_fuse else []
    return env + ([{"name": COMPILE_CACHE_VAR, "value": cluster.compile_cache}] if cluster.compile_cache else [])


def termination(cluster: RayClusterSpec) -> tuple[dict, dict]:
    """A TPU worker's (container fields, pod fields) for its end, sized to what its capacity grants
    (infra/cloud/capacity.py): the preStop hook drains the pod's Ray node (infra/resources/stop_hook.py) and `ray start`,
    which gets SIGTERM after it, finds the node drained and waits at most RAY_SHUTDOWN_DRAIN_S more."""
    grace = cluster.capacity.grace(cluster.autopilot)
    container = {
        "env": [{"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": str(RAY_SHUTDOWN_DRAIN_S)}],
        "lifecycle": {"preStop": {"exec": {"command": stop_hook(grace.drain_s)}}},
    }
    return container, {"terminationGracePeriodSeconds": grace.seconds}


def ray_cluster_manifest(cluster: RayClusterSpec, image: str) -> dict:
    """The RayCluster as a plain dict: one CPU head, one worker group of a replica per slice."""
    tpu = cluster.tpu
    env = [_token_env(), *tpu.ray_env]
    selectors = tpu.node_selector | (_autopilot_selectors(cluster.capacity) if cluster.autopilot else {})
    stop_container, stop_pod = termination(cluster)
    worker_group = {
        "groupName": tpu.worker_group,
        **worker_replicas(cluster.capacity, cluster.num_slices),
        "numOfHosts": tpu.hosts,
        "rayStartParams": tpu.ray_start_params,
        "template": {
            "spec": {
                "serviceAccountName": cluster.service_account,
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": image,
                        "env": env + torch_tpu_env(cluster) + stop_container["env"],
                        "resources": {"requests": tpu.worker_resources, "limits": tpu.worker_resources},
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                        "lifecycle": stop_container["lifecycle"],
                    }
                ],
                **stop_pod,
                "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": tpu.shm_size}}],
                "nodeSelector": selectors,
            }
        },
    }
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
                        "serviceAccountName": cluster.service_account,
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": image,
                                "ports": [{"containerPort": port, "name": name} for name, port in HEAD_PORTS],
                                "env": env,
                                "resources": {"requests": HEAD_RESOURCES, "limits": HEAD_RESOURCES},
                            }
                        ],
                    }
                },
            },
            "workerGroupSpecs": [worker_group],
        },
    }


def identity_objects(namespace: str, service_account: str) -> list[dict]:
    """What the pods' identity needs that a new cluster lacks: the namespace (but `default`) and the
    ServiceAccount in it (but `default`, which every namespace has). The pods run as that account, and the
    bucket's IAM member names the same one (infra/resources/storage.py)."""
    objects = []
    if namespace != "default":
        objects.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    if service_account != "default":
        objects.append({"apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": service_account, "namespace": namespace}})  # fmt: skip
    return objects


@dataclass(frozen=True, kw_only=True)
class RayClusterArgs:
    spec: RayClusterSpec
    image: pulumi.Input[str]  # by digest
    hf_token: pulumi.Input[str]  # secret
    endpoint: pulumi.Input[str]  # the cluster's API server, for the CRD wait
    ca_certificate: pulumi.Input[str]


class RayCluster(pulumi.ComponentResource):
    """The pods' namespace and ServiceAccount (when not default), the token Secret, the CRD wait and the
    RayCluster; done only when the head pod is ready. The Kubernetes provider comes in `opts.providers`; what
    the RayCluster must wait for (the node pools, the bucket's grant), in `opts.depends_on`."""

    def __init__(self, name: str, args: RayClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:RayCluster", name, None, opts)
        cluster, hf_token = args.spec, args.hf_token
        depends_on = list((opts.depends_on if opts else None) or [])
        k8s_opts = pulumi.ResourceOptions(parent=self)
        self.identity: list[pulumi.Resource] = []
        for obj in identity_objects(cluster.namespace, cluster.service_account):
            kind = {"Namespace": k8s.core.v1.Namespace, "ServiceAccount": k8s.core.v1.ServiceAccount}[obj["kind"]]
            after = pulumi.ResourceOptions(depends_on=self.identity)  # the namespace first
            self.identity.append(kind(f"{name}-{obj['kind'].lower()}", metadata=obj["metadata"],
                                      opts=k8s_opts.merge(after)))  # fmt: skip
        self.secret = k8s.core.v1.Secret(
            f"{name}-hf-token",
            metadata={"name": TOKEN_SECRET, "namespace": cluster.namespace},
            type="Opaque",
            string_data={TOKEN_KEY: pulumi.Output.secret(hf_token)},
            opts=k8s_opts.merge(pulumi.ResourceOptions(depends_on=self.identity)),
        )
        self.crd = CrdEstablished(
            f"{name}-crd",
            endpoint=args.endpoint,
            ca_certificate=args.ca_certificate,
            crd=RAYCLUSTER_CRD,
            opts=pulumi.ResourceOptions(parent=self),
        )
        spec = pulumi.Output.from_input(args.image).apply(lambda ref: ray_cluster_manifest(cluster, ref)["spec"])
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
                    depends_on=[self.crd, self.secret, *self.identity, *depends_on],
                    custom_timeouts=pulumi.CustomTimeouts(create="60m", update="60m"),
                )
            ),
        )
        self.name = self.ray_cluster.metadata["name"]
        self.register_outputs({"name": self.name})
