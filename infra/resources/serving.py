"""Serving: a single-host TPU node pool of its own (Standard mode), and a KubeRay RayService running Ray Serve LLM's
OpenAI app on it, its own Ray cluster beside the training one. The endpoint is private: KubeRay's ClusterIP Service
`<name>-serve-svc`, reached with the port-forward command the stack exports."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s
import yaml

from infra import PROJECT
from infra.config.serving_checks import served_as_run_read
from infra.resources.kube import credentials_command
from infra.resources.raycluster import API_VERSION, HEAD_PORTS, TOKEN_KEY, TOKEN_SECRET, ray_version
from infra.serving.app import (
    SERVE_HEAD_CPUS,
    SERVE_HEAD_RESOURCES,
    SERVE_PORT,
    ServeConfig,
    serve_config,
    served_model_name,
)

KIND = "RayService"
SERVE_POOL_NAME = "tpu-serve-pool"
# How long the autoscaler keeps an idle TPU worker once Serve has scaled its replicas to serveMinReplicas.
IDLE_TIMEOUT_S = 600
VLLM_CACHE_PREFIX = "vllm_xla_cache"
# Upgrades on purpose. KubeRay's default for a changed rayClusterConfig (an image rebuild, a Ray version) is
# NewCluster: a second cluster beside the first until the new one serves (v1.7.0 rayservice_controller.go,
# shouldPrepareNewCluster and isZeroDowntimeUpgradeEnabled). Its TPU hosts would come from a pool whose most nodes is
# serveReplicas, all held by the old cluster while serveMinReplicas > 0, so the new one never becomes ready; its head
# would need a second head's room on the CPU node. NewClusterWithIncrementalUpgrade (v1.5+) needs the Gateway API
# and is not in v1.4.2's CRD. So `None` (both CRDs; validation.go accepts it in v1.4.2 and v1.7.0): KubeRay never
# starts a second cluster, and Pulumi replaces the RayService, the old one deleted first (SERVICE_REPLACEMENT), when
# the cluster's spec changes; a new serveConfigV2 alone (a new export) is still applied in place by KubeRay.
UPGRADE_STRATEGY = {"type": "None"}
SERVICE_REPLACEMENT = {"replace_on_changes": ["spec.rayClusterConfig"], "delete_before_replace": True}


@dataclass(frozen=True, kw_only=True)
class ServingSpec:
    """What the RayService's manifest is made of."""

    name: str  # the RayService (a DNS-1035 label); KubeRay names its Service `<name>-serve-svc`
    namespace: str
    service_account: str  # the bucket's grantee: the replica downloads a gs:// export as it
    serve: ServeConfig
    model_name: str  # served_model_name
    autopilot: bool
    xla_cache: str = ""  # VLLM_XLA_CACHE_PATH, gs:// (a single host's, so no race between hosts); "" none
    credentials: str = ""  # the command that gives kubectl a context for the cluster (kube.credentials_command)


def serving_spec(cfg, name: str) -> ServingSpec:
    """The spec from the stack's config (a StackConfig with `serve`)."""
    return ServingSpec(name=name, namespace=cfg.namespace, service_account=cfg.service_account, serve=cfg.serve,
                       model_name=served_model_name(cfg.job.model, cfg.serve.what), autopilot=cfg.autopilot,
                       xla_cache=f"gs://{cfg.bucket_name}/{VLLM_CACHE_PREFIX}" if cfg.compile_cache else "",
                       credentials=credentials_command(cfg.cluster_name, cfg.location, cfg.project))  # fmt: skip


def serve_service(name: str) -> str:
    return f"{name}-serve-svc"


def endpoint(spec: ServingSpec) -> dict:
    """The `endpoint` output: the in-cluster URL, the kube context the port-forward needs (`credentials`, once), the
    port-forward that reaches it from a laptop, and a request."""
    service = serve_service(spec.name)
    body = {"model": spec.model_name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32}
    return {
        "url": f"http://{service}.{spec.namespace}.svc.cluster.local:{SERVE_PORT}/v1",
        "credentials": spec.credentials,
        "port_forward": f"kubectl -n {spec.namespace} port-forward svc/{service} {SERVE_PORT}:{SERVE_PORT}",
        "curl": f"curl -s http://127.0.0.1:{SERVE_PORT}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{json.dumps(body)}'",
        "model": spec.model_name,
    }


def _token_env() -> dict:
    return {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET, "key": TOKEN_KEY}}}


def worker_selectors(spec: ServingSpec) -> dict[str, str]:
    """The serving host's labels; Spot asked for by the pod on Autopilot (Standard's pool is Spot itself)."""
    spot = {"cloud.google.com/gke-spot": "true"} if spec.autopilot and spec.serve.capacity == "spot" else {}
    return spec.serve.host.node_selector | spot


def worker_group(spec: ServingSpec, image: str) -> dict:
    """The TPU worker group: a replica a single host, between serveMinReplicas and serveReplicas."""
    serve, host = spec.serve, spec.serve.host
    env = [_token_env(), *host.ray_env] + ([{"name": "VLLM_XLA_CACHE_PATH", "value": spec.xla_cache}]
                                          if spec.xla_cache else [])  # fmt: skip
    return {
        "groupName": host.worker_group,
        "replicas": serve.min_replicas,
        "minReplicas": serve.min_replicas,
        "maxReplicas": serve.max_replicas,
        "numOfHosts": 1,
        "rayStartParams": host.ray_start_params,
        "template": {
            "spec": {
                "serviceAccountName": spec.service_account,
                "containers": [{"name": "ray-worker", "image": image, "env": env,
                                "resources": {"requests": host.pod_resources, "limits": host.pod_resources}}],
                "nodeSelector": worker_selectors(spec),
            }
        },
    }  # fmt: skip


def head_group(spec: ServingSpec, image: str) -> dict:
    """The CPU head: Serve's controller, its proxy on SERVE_PORT (KubeRay's Service points there) and the ingress."""
    ports = [*HEAD_PORTS, ("serve", SERVE_PORT)]
    container = {"name": "ray-head", "image": image,
                 "ports": [{"containerPort": port, "name": name} for name, port in ports], "env": [_token_env()],
                 "resources": {"requests": SERVE_HEAD_RESOURCES, "limits": SERVE_HEAD_RESOURCES}}  # fmt: skip
    return {
        "rayStartParams": {"num-cpus": str(SERVE_HEAD_CPUS)},
        "template": {"spec": {"serviceAccountName": spec.service_account, "containers": [container]}},
    }


def as_run_read(spec: ServingSpec, modality_read: str | None) -> ServingSpec:
    """The spec for what the run's records held (modality auto: known once it has run); raises for what cannot be
    served as it is (serving_checks.served_as_run_read), which fails `up` at the endpoint with the reason."""
    if modality_read is None:
        return spec
    return replace(spec, serve=served_as_run_read(spec.serve, modality_read))


def ray_service_manifest(spec: ServingSpec, image: str, model_source: str) -> dict:
    """The RayService as a plain dict: a CPU head, one worker group of single-host TPU replicas that the in-tree
    autoscaler scales as Serve does, and the OpenAI app serving `model_source`."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(spec.serve, spec.model_name, model_source), sort_keys=False),
            "upgradeStrategy": UPGRADE_STRATEGY,
            "rayClusterConfig": {
                "rayVersion": ray_version(),
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"idleTimeoutSeconds": IDLE_TIMEOUT_S},
                "headGroupSpec": head_group(spec, image),
                "workerGroupSpecs": [worker_group(spec, image)],
            },
        },
    }


def serving_pool_args(serve: ServeConfig, project: str, zone: str, cluster_name: pulumi.Input[str]) -> dict:
    """Standard mode's serving pool: the single-host machine type, 0 nodes until a replica asks for one, at most one
    a replica; Spot if asked. No placement policy: a single host has no slice to place."""
    node = {"machine_type": serve.host.machine_type, "workload_metadata_config": {"mode": "GKE_METADATA"},
            "gcfs_config": {"enabled": True}} | ({"spot": True} if serve.capacity == "spot" else {})  # fmt: skip
    return {
        "name": SERVE_POOL_NAME,
        "project": project,
        "cluster": cluster_name,
        "location": zone,
        "initial_node_count": 0,
        "autoscaling": {"min_node_count": 0, "max_node_count": serve.max_replicas, "location_policy": "ANY"},
        "node_locations": [zone],
        "node_config": node,
    }


@dataclass(frozen=True, kw_only=True)
class ServingEndpointArgs:
    spec: ServingSpec
    image: pulumi.Input[str]  # the serving image, by digest
    model_source: pulumi.Input[str]  # the run's export (gs://, the job resource's output) or the starting model
    pool: dict | None  # serving_pool_args in Standard mode; None on Autopilot (its pods ask for the TPU)
    # modality auto: what the run's records held (its data report's modality), which decides how it is served
    modality_read: pulumi.Input[str] | None = None


class ServingEndpoint(pulumi.ComponentResource):
    """The serving pool (Standard) and the RayService. The Kubernetes provider comes in `opts.providers`; what the
    RayService must come after (the export, the token Secret, the bucket's grant), in `opts.depends_on`."""

    def __init__(self, name: str, args: ServingEndpointArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:ServingEndpoint", name, None, opts)
        spec = args.spec
        depends_on = list((opts.depends_on if opts else None) or [])
        self.pool = None
        if args.pool is not None:
            self.pool = gcp.container.NodePool(
                f"{name}-tpu", **args.pool,
                # the autoscaler owns the node count; Pulumi must not set it back
                opts=pulumi.ResourceOptions(parent=self, ignore_changes=["nodeCount"],
                                            custom_timeouts=pulumi.CustomTimeouts(create="30m")),
            )  # fmt: skip
        manifest = pulumi.Output.all(args.image, args.model_source, args.modality_read).apply(
            lambda found: ray_service_manifest(as_run_read(spec, found[2]), found[0], found[1])["spec"]
        )
        self.ray_service = k8s.apiextensions.CustomResource(
            name,
            api_version=API_VERSION,
            kind=KIND,
            metadata={"name": spec.name, "namespace": spec.namespace},
            spec=manifest,
            opts=pulumi.ResourceOptions(
                parent=self, depends_on=[*depends_on, *([self.pool] if self.pool else [])], **SERVICE_REPLACEMENT
            ),  # fmt: skip
        )
        self.endpoint = endpoint(spec)
        self.serve_config = manifest.apply(lambda declared: declared["serveConfigV2"])
        self.register_outputs({"endpoint": self.endpoint})
