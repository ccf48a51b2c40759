"""TPU generations the stack can slice, and everything a slice derives from one row.

One table, xpk-style: a fact about a generation is typed once here; hosts, devices,
labels, names and pod sizes are computed from it, never written again elsewhere.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

# GKE's floor for the managed Ray Operator add-on, whatever the TPU.
RAY_ADDON_MIN_GKE = "1.30.0-gke.1747000"


@dataclass(frozen=True)
class TpuGeneration:
    name: str
    machine_type: str
    chips_per_host: int
    devices_per_chip: int  # logical devices (chiplets) per physical chip
    gke_accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
    ray_accelerator_type: str
    topologies: tuple[str, ...]  # multi-host slice shapes GKE offers for machine_type
    host_cpu: int  # worker pod requests = limits, one pod per host
    host_memory_gi: int
    shm_gi: int  # /dev/shm for the compilation cache and data loader
    min_gke_standard: str
    min_gke_autopilot: str
    peak_bf16_tflops_per_chip: float  # dense bf16, the denominator of MFU
    hbm_gib_per_chip: int  # all of its devices together
    # Ironwood places multi-host slices with a HIGH_THROUGHPUT workload policy
    # (a compute resource policy carrying the accelerator topology).
    uses_workload_policy: bool = False

    @property
    def placement_type(self) -> str:
        """The node pool's placement_policy.type.

        COMPACT, except next to a workload policy: GKE refuses a tpu7x pool with a placement
        type ("... tpu7x-standard-4t machine type with placement policy is not supported. Use
        workload policy instead.") and stores only policyName + tpuTopology for the one that
        works, so a stated type would also diff, and replace the slice, on every `up`
        (vllm-project/ci-infra#547; xpk#676: workload and group placement policies are
        mutually exclusive). pulumi-gcp requires the field but omits an empty string.
        """
        return "" if self.uses_workload_policy else "COMPACT"


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration(
            name="v6e",
            machine_type="ct6e-standard-4t",
            chips_per_host=4,
            devices_per_chip=1,
            gke_accelerator="tpu-v6e-slice",
            ray_accelerator_type="TPU-V6E",
            topologies=("4x4", "4x8", "8x8", "8x16", "16x16"),
            host_cpu=64,
            host_memory_gi=200,
            shm_gi=100,
            min_gke_standard=RAY_ADDON_MIN_GKE,
            min_gke_autopilot=RAY_ADDON_MIN_GKE,
            peak_bf16_tflops_per_chip=918,
            # cloud.google.com/tpu/docs/tpu7x: "HBM capacity per chip (GiB)": v6e 32, TPU7x 192
            hbm_gib_per_chip=32,
        ),
        TpuGeneration(
            name="tpu7x",
            machine_type="tpu7x-standard-4t",
            chips_per_host=4,
            devices_per_chip=2,
            gke_accelerator="tpu7x",
            ray_accelerator_type="TPU-V7X",
            topologies=("2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
            host_cpu=64,
            host_memory_gi=250,
            shm_gi=128,
            min_gke_standard="1.34.0-gke.2201000",
            min_gke_autopilot="1.34.1-gke.3084001",
            peak_bf16_tflops_per_chip=2307,  # both chiplets together
            hbm_gib_per_chip=192,
            uses_workload_policy=True,
        ),
    )
}

_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def is_topology(text: str) -> bool:
    return bool(_TOPOLOGY.match(text))


@dataclass(frozen=True)
class TpuSlice:
    """One multi-host slice: a generation and one of its topologies."""

    generation: TpuGeneration
    topology: str

    @property
    def chips(self) -> int:
        return math.prod(int(d) for d in self.topology.split("x"))

    @property
    def hosts(self) -> int:
        return self.chips // self.generation.chips_per_host

    @property
    def devices_per_host(self) -> int:
        return self.generation.chips_per_host * self.generation.devices_per_chip

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def hbm_gib_per_device(self) -> float:
        return self.generation.hbm_gib_per_chip / self.generation.devices_per_chip

    @property
    def worker_group(self) -> str:
        return f"{self.generation.name}-{self.devices}"

    @property
    def ray_start_params(self) -> dict[str, str]:
        """The worker group's rayStartParams: where Ray cannot count chiplets from google.com/tpu (KubeRay would
        advertise its 4 chips), the TPU resource per host.

        In rayStartParams, not the group's `resources` field: that field first appears in KubeRay v1.5.0
        (ray-project/kuberay#4106), an older operator's CRD has no such field, and v1.7.0 refuses the two
        together (ray-operator/controllers/ray/utils/validation.go, validateRayGroupResources). The value is
        quoted as KubeRay's own conversion writes it (pod.go, updateRayStartParamsResources: '{"TPU":8}'):
        the pod's bash takes the quotes, and KubeRay's parser (getResourcesMap, which trims them) and Ray's
        autoscaler (kuberay/autoscaling_config.py, _get_custom_resources, which drops the outer pair) read it.
        """
        if self.generation.devices_per_chip == 1:
            return {}
        return {"resources": "'" + json.dumps({"TPU": self.devices_per_host}, separators=(",", ":")) + "'"}

    @property
    def ray_env(self) -> list[dict]:
        if self.generation.devices_per_chip == 1:
            return []
        return [{"name": "RAY_TPU_RESOURCE_PER_CHIP", "value": str(self.generation.devices_per_chip)}]

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

    @property
    def node_selector(self) -> dict[str, str]:
        return {
            "cloud.google.com/gke-tpu-accelerator": self.generation.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": self.topology,
        }
