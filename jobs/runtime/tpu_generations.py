"""TPU generations: one typed row each, every fact about a generation written once (xpk's system
characteristics). The stack derives its node pools, pod sizes, labels and names from a row (infra/cloud/tpu.py);
the jobs, which travel without the stack, read the same rows for their devices, slices and peak FLOP/s.
Torch-free and Ray-free.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# GKE's floor for the managed Ray Operator add-on, whatever the TPU.
RAY_ADDON_MIN_GKE = "1.30.0-gke.1747000"


@dataclass(frozen=True)
class TpuGeneration:
    name: str
    machine_type: str
    ray_version: str  # Ray's accelerator version (ray.util.tpu): what its slice placement groups are asked for
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
    # The single-host shapes a serving pool may take, smallest first: topology -> GKE machine type.
    serving_shapes: tuple[tuple[str, str], ...] = ()

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
            ray_version="v6e",
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
            # cloud.google.com/tpu/docs/v6e, "Supported configurations" (read 2026-12): 1x1 ct6e-standard-1t and
            # 2x2 ct6e-standard-4t (sub-host), 2x4 ct6e-standard-8t (single host), each "Supports inference? Yes"
            serving_shapes=(("1x1", "ct6e-standard-1t"), ("2x2", "ct6e-standard-4t"), ("2x4", "ct6e-standard-8t")),
        ),
        TpuGeneration(
            name="tpu7x",
            machine_type="tpu7x-standard-4t",
            ray_version="v7x",
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
            # GKE's "Plan TPUs" page (read 2026-12): TPU7x's one single-host shape is 2x2x1, one tpu7x-standard-4t VM
            serving_shapes=(("2x2x1", "tpu7x-standard-4t"),),
        ),
    )
}

_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def is_topology(text: str) -> bool:
    return bool(_TOPOLOGY.match(text))


def chips_of(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def by_accelerator_type(accelerator_type: str) -> TpuGeneration | None:
    """The row of Ray's accelerator type (TPU-V6E, TPU-V7X), or None."""
    return next((g for g in GENERATIONS.values() if g.ray_accelerator_type == accelerator_type), None)


ACCELERATOR_TYPES = tuple(g.ray_accelerator_type for g in GENERATIONS.values())
