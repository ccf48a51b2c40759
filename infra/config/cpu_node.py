"""Standard mode's one CPU node (headMachineType): what GKE leaves for pods on it, and every pod that lands there.

The TPU nodes are tainted (GKE taints every TPU node google.com/tpu=present:NoSchedule, "Plan TPUs in GKE"), so
every pod without a TPU lands on the one CPU node of the cluster's default pool (a fixed node: initial_node_count 1,
infra/resources/cluster.py): the training head, the serving head with its autoscaler sidecar, GKE's own system pods.
A head that does not fit stays Pending, and `up` waits for a RayCluster that never starts. Counted at preview.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from infra.cloud.capacity import HEAD_RESOURCES
from infra.config.reader import Reader, key
from infra.serving.app import SERVE_HEAD_RESOURCES, ServeConfig

# GKE's reservation on a Standard node ("Standard cluster architecture", Node allocatable resources, read 2026-12):
# memory 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8, 6% of the next 112, 2% above 128 GiB, plus
# the kubelet's 100 MiB eviction threshold; CPU 6% of the first core, 1% of the next, 0.5% of the next 2, 0.25%
# above 4 cores.
MEMORY_TIERS_GIB = ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02))
EVICTION_MIB = 100
CPU_TIERS = ((1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025))
# vCPUs and GiB of memory of a predefined Compute Engine machine type (GCE's machine families page, read 2026-12):
# standard 4 GiB a vCPU (n1: 3.75), highmem 8 (n1: 6.5), highcpu 1 (n1: 0.9).
_GIB_PER_VCPU = {"standard": 4.0, "highmem": 8.0, "highcpu": 1.0}
_N1_GIB_PER_VCPU = {"standard": 3.75, "highmem": 6.5, "highcpu": 0.9}
_PREDEFINED = re.compile(r"^(n1|n2|n2d|n4|e2|c2d|c3|c3d|c4|t2d)-(standard|highmem|highcpu)-(\d+)$")
# KubeRay's autoscaler sidecar in a pod of a RayCluster with enableInTreeAutoscaling (v1.7.0
# ray-operator/controllers/ray/common/pod.go, BuildAutoscalerContainer: 500m and 512Mi, requests = limits).
AUTOSCALER_SIDECAR = (500, 512)
# GKE's own pods on a one-node Standard cluster (kube-dns and its autoscaler, konnectivity-agent, metrics-server,
# the Dataplane V2 agent, fluentbit-gke, gke-metrics-agent, the PD CSI node, the Ray add-on's log collection): an
# allowance, not a published figure; what `kubectl describe node` shows of their requests is the measure.
SYSTEM_PODS = (1000, 1536)


@dataclass(frozen=True)
class Pod:
    """What one pod requests: millicores and MiB."""

    name: str
    cpu_m: int
    memory_mi: int


def quantity_m(cpu: str) -> int:
    return int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)


def quantity_mi(memory: str) -> int:
    units = {"Mi": 1, "Gi": 1024}
    return int(float(memory[:-2]) * units[memory[-2:]])


def pod(name: str, resources: dict[str, str], sidecar: bool = False) -> Pod:
    """A pod from its main container's requests, with the autoscaler sidecar where KubeRay adds one."""
    cpu, memory = quantity_m(resources["cpu"]), quantity_mi(resources["memory"])
    return Pod(name, cpu + AUTOSCALER_SIDECAR[0] * sidecar, memory + AUTOSCALER_SIDECAR[1] * sidecar)


def machine_shape(machine_type: str) -> tuple[int, float] | None:
    """(vCPUs, GiB) of a predefined machine type; None for a custom or unknown one (not counted)."""
    m = _PREDEFINED.fullmatch(machine_type)
    if m is None:
        return None
    family, kind, vcpus = m.group(1), m.group(2), int(m.group(3))
    return vcpus, vcpus * (_N1_GIB_PER_VCPU if family == "n1" else _GIB_PER_VCPU)[kind]


def _tiered(total: float, tiers) -> float:
    reserved, left = 0.0, total
    for size, share in tiers:
        part = min(left, size)
        reserved, left = reserved + part * share, left - part
    return reserved


def allocatable(vcpus: int, memory_gib: float) -> tuple[int, int]:
    """What GKE leaves for pods on a node of that shape: (millicores, MiB)."""
    cpu_m = vcpus * 1000 - round(_tiered(vcpus, CPU_TIERS) * 1000)
    memory_mi = int(memory_gib * 1024 - _tiered(memory_gib, MEMORY_TIERS_GIB) * 1024) - EVICTION_MIB
    return cpu_m, memory_mi


def room_problem(machine_type: str, pods: list[Pod]) -> str | None:
    """A sentence naming what does not fit on one node of `machine_type`, with the pods' sum; None when they fit or
    the type's shape is not known here."""
    shape = machine_shape(machine_type)
    if shape is None:
        return None
    cpu_m, memory_mi = allocatable(*shape)
    pods = [*pods, Pod("GKE's system pods (an allowance)", *SYSTEM_PODS)]
    need_cpu, need_memory = sum(p.cpu_m for p in pods), sum(p.memory_mi for p in pods)
    if need_cpu <= cpu_m and need_memory <= memory_mi:
        return None
    listed = ", ".join(f"{p.name} {p.cpu_m}m/{p.memory_mi}Mi" for p in pods)
    return (f"the pods on the CPU node ({listed}) request {need_cpu}m CPU and {need_memory}Mi, more than the "
            f"{cpu_m}m and {memory_mi}Mi GKE leaves for pods on one {machine_type} ({shape[0]} vCPUs, "
            f"{shape[1]:g} GiB)")  # fmt: skip


def head_pods(serve: ServeConfig | None) -> list[Pod]:
    """The stack's pods on the CPU node: the training head (no autoscaler: the stack scales its slices itself), and
    with serving the serving head and its autoscaler sidecar."""
    pods = [pod("the training head", HEAD_RESOURCES)]
    if serve is not None:
        pods.append(pod("the serving head with its autoscaler", SERVE_HEAD_RESOURCES, sidecar=True))
    return pods


def check_room(r: Reader, machine_type: str, serve: ServeConfig | None) -> None:
    """Standard mode: refuse a headMachineType whose one node cannot hold the pods, naming a type that can."""
    pods = head_pods(serve)
    problem = room_problem(machine_type, pods)
    if problem is None:
        return
    fits = next((f"n2-standard-{n}" for n in (4, 8, 16, 32) if room_problem(f"n2-standard-{n}", pods) is None), None)
    r.problem(f"{key('headMachineType')}: {problem}; set a larger one"
              + (f" (pulumi config set headMachineType {fits})" if fits else ""))  # fmt: skip
