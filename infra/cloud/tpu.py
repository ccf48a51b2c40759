"""A TPU slice: a generation's row (jobs/runtime/tpu_generations.py, the one table, which the jobs read too) and one of
its topologies, and everything the stack derives from them: hosts, devices, the worker group's name, node
selectors, pod sizes, Ironwood's extras. Never written again elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from infra.job_modules import tpu_generations

GENERATIONS, TpuGeneration = tpu_generations.GENERATIONS, tpu_generations.TpuGeneration
is_topology, chips_of = tpu_generations.is_topology, tpu_generations.chips_of


def ray_start_params(generation: TpuGeneration, devices_per_host: int, *, autoscaled: bool = False) -> dict[str, str]:
    """A TPU worker group's rayStartParams: where Ray cannot count chiplets from google.com/tpu (KubeRay would
    advertise its 4 chips), the TPU resource per host; in a group Ray's autoscaler starts (`autoscaled`), also the
    accelerator type's resource that every TPU node has once it runs.

    In rayStartParams, not the group's `resources` field: that field first appears in KubeRay v1.5.0
    (ray-project/kuberay#4106), an older operator's CRD has no such field, and v1.7.0 refuses the two
    together (ray-operator/controllers/ray/utils/validation.go, validateRayGroupResources). The value is
    quoted as KubeRay's own conversion writes it (pod.go, updateRayStartParamsResources: '{"TPU":8}'):
    the pod's bash takes the quotes, and KubeRay's parser (getResourcesMap, which trims them) and Ray's
    autoscaler (kuberay/autoscaling_config.py, _get_custom_resources, which drops the outer pair) read it.

    Why the accelerator type: Ray Serve LLM asks every TPU bundle for `accelerator_type:TPU-V6E: 0.001`
    (ray/llm/_internal/serve/engines/vllm/vllm_models.py, placement_bundles), which a running TPU node offers
    (ray/_private/resource_and_label_spec.py, _resolve_accelerator_resources: the type at 1). But the in-tree
    autoscaler knows a group that has no node yet only from the RayCluster: CPU, GPU, TPU, TPU-<type>-head,
    memory and these rayStartParams resources (ray/autoscaler/_private/kuberay/autoscaling_config.py,
    _get_ray_resources_from_group_spec). Without it no node type fits the bundle and the host is never added.
    Stated here at the node's own value (1), so Ray's detection on the host sets it to what it already is.
    """
    resources = {"TPU": devices_per_host} if generation.devices_per_chip > 1 else {}
    if autoscaled:
        resources[accelerator_resource(generation)] = 1
    if not resources:
        return {}
    return {"resources": "'" + json.dumps(resources, separators=(",", ":")) + "'"}


def accelerator_resource(generation: TpuGeneration) -> str:
    """Ray's resource for a node's accelerator type (ray_constants.RESOURCE_CONSTRAINT_PREFIX + the type)."""
    return f"accelerator_type:{generation.ray_accelerator_type}"


def ray_env(generation: TpuGeneration) -> list[dict]:
    """Ray's TPU resource per chip where a chip is several devices (Ironwood's chiplets)."""
    if generation.devices_per_chip == 1:
        return []
    return [{"name": "RAY_TPU_RESOURCE_PER_CHIP", "value": str(generation.devices_per_chip)}]


@dataclass(frozen=True)
class TpuShape:
    """A generation's chips in one topology: what a slice and a serving host both are."""

    generation: TpuGeneration
    topology: str

    @property
    def chips(self) -> int:
        return chips_of(self.topology)

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def hbm_gib_per_device(self) -> float:
        return self.generation.hbm_gib_per_chip / self.generation.devices_per_chip

    @property
    def ray_env(self) -> list[dict]:
        return ray_env(self.generation)

    @property
    def node_selector(self) -> dict[str, str]:
        return {
            "cloud.google.com/gke-tpu-accelerator": self.generation.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": self.topology,
        }


@dataclass(frozen=True)
class TpuSlice(TpuShape):
    """One multi-host slice: a generation and one of its topologies."""

    @property
    def hosts(self) -> int:
        return self.chips // self.generation.chips_per_host

    @property
    def devices_per_host(self) -> int:
        return self.generation.chips_per_host * self.generation.devices_per_chip

    @property
    def worker_group(self) -> str:
        return f"{self.generation.name}-{self.devices}"

    @property
    def ray_start_params(self) -> dict[str, str]:
        return ray_start_params(self.generation, self.devices_per_host)

    @property
    def worker_resources(self) -> dict[str, str]:
        g = self.generation
        return {
            "cpu": str(g.host_cpu),
            "memory": f"{g.host_memory_gi}Gi",
            "google.com/tpu": str(g.chips_per_host),
        }

    @property
    def shm_size(self) -> str:
        return f"{self.generation.shm_gi}Gi"


@dataclass(frozen=True)
class ServingHost(TpuShape):
    """One single-host TPU shape of a generation (its `serving_shapes`): what a serving replica runs on, every chip
    of one VM, with vLLM's tensor parallelism over its devices."""

    machine_type: str

    @property
    def worker_group(self) -> str:
        return f"{self.generation.name}-serve-{self.devices}"

    @property
    def ray_start_params(self) -> dict[str, str]:
        return ray_start_params(self.generation, self.devices, autoscaled=True)

    @property
    def pod_resources(self) -> dict[str, str]:
        """A replica's pod: every chip of the VM, and the host CPU and memory in the chips' share of the training
        host's pod (TpuGeneration.host_cpu, host_memory_gi: a 4-chip host's), so a 1-chip VM's pod fits on it."""
        g, share = self.generation, self.chips / self.generation.chips_per_host
        return {"cpu": str(max(4, int(g.host_cpu * share))), "memory": f"{max(16, int(g.host_memory_gi * share))}Gi",
                "google.com/tpu": str(self.chips)}  # fmt: skip


def serving_hosts(generation: TpuGeneration) -> list[ServingHost]:
    """The generation's single-host shapes, smallest first."""
    return [ServingHost(generation, topology, machine) for topology, machine in generation.serving_shapes]
