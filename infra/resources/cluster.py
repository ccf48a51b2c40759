"""The GKE cluster with the Ray Operator add-on, and in Standard mode its TPU slice node pools (one a slice)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra import PROJECT
from infra.cloud.capacity import CRITICAL_PODS_SHUTDOWN_S, SliceCapacity
from infra.cloud.tpu import TpuSlice

TPU_POOL_NAME = "tpu-multi-host-pool"


@dataclass(frozen=True, kw_only=True)
class ClusterArgs:
    name: str
    project: str
    location: str  # a zone in Standard mode, a region in Autopilot
    version: str
    deletion_protection: bool
    autopilot: bool
    head_machine_type: str  # Standard: the CPU node that hosts the Ray head
    scale_to_zero: bool


@dataclass(frozen=True, kw_only=True)
class TpuPoolArgs:
    """Standard mode's TPU slice node pools (Autopilot has none: its pods ask for TPUs)."""

    project: str
    zone: str
    region: str
    tpu: TpuSlice
    capacity: SliceCapacity
    num_slices: int = 1


def tpu_pool_name(index: int) -> str:
    """A multi-host slice needs a node pool of its own (the KubeRay TPU webhook keeps each worker-group
    replica on one pool); the first keeps the walkthrough's name, the others are numbered from 2, all in
    the one zone Multislice requires."""
    return TPU_POOL_NAME if index == 0 else f"{TPU_POOL_NAME}-{index + 1}"


def ray_addon() -> gcp.container.ClusterAddonsConfigArgs:
    # Typed args, so a misspelt field fails here rather than passing through as an unknown key.
    return gcp.container.ClusterAddonsConfigArgs(
        ray_operator_configs=[
            gcp.container.ClusterAddonsConfigRayOperatorConfigArgs(
                enabled=True,
                ray_cluster_logging_config={"enabled": True},
                ray_cluster_monitoring_config={"enabled": True},
            )
        ]
    )


def cluster_args(cluster: ClusterArgs) -> dict:
    """Inputs of the container.Cluster for the chosen mode."""
    common = {
        "name": cluster.name,
        "project": cluster.project,
        "location": cluster.location,
        "min_master_version": cluster.version,
        "deletion_protection": cluster.deletion_protection,
        "addons_config": ray_addon(),
    }
    if cluster.autopilot:
        # Autopilot brings Workload Identity, Dataplane V2 and image streaming itself.
        return common | {"enable_autopilot": True}
    standard = {
        "initial_node_count": 1,
        "node_config": {
            "machine_type": cluster.head_machine_type,
            "gcfs_config": {"enabled": True},
            "workload_metadata_config": {"mode": "GKE_METADATA"},
        },
        "datapath_provider": "ADVANCED_DATAPATH",
        "workload_identity_config": {"workload_pool": f"{cluster.project}.svc.id.goog"},
    }
    if cluster.scale_to_zero:
        # The autoscaler profile that removes idle nodes sooner; `enabled` is node auto-provisioning, off.
        standard["cluster_autoscaling"] = {"enabled": False, "autoscaling_profile": "OPTIMIZE_UTILIZATION"}
    return common | standard


def workload_policy_args(cluster_name: str, pool: TpuPoolArgs) -> dict:
    return {
        "name": f"{cluster_name}-placement",
        "project": pool.project,
        "region": pool.region,
        "workload_policy": {"type": "HIGH_THROUGHPUT", "accelerator_topology": pool.tpu.topology},
    }


def tpu_node_config(pool: TpuPoolArgs) -> dict:
    node = {
        "machine_type": pool.tpu.generation.machine_type,
        "workload_metadata_config": {"mode": "GKE_METADATA"},
        "gcfs_config": {"enabled": True},
    }
    capacity = pool.capacity
    if capacity.spot:
        # Preempted, the pods get 15 s of the VM's 30 s unless the kubelet's shutdown grace is raised
        # (infra/cloud/capacity.py): raised, the training saves its step and Ray Train moves the run in time.
        grace = capacity.grace(autopilot=False)
        node["spot"] = True
        node["kubelet_config"] = {
            "shutdown_grace_period_seconds": grace.kubelet_shutdown_s,
            "shutdown_grace_period_critical_pods_seconds": CRITICAL_PODS_SHUTDOWN_S,
        }
    if capacity.flex_start:
        # Dynamic Workload Scheduler: GKE gets the capacity when the slice is asked for, and the nodes
        # run at most this long (provisioning, then the collectives check and the fine-tune).
        node |= {"flex_start": True, "max_run_duration": f"{capacity.run_minutes * 60}s"}
    if capacity.reservation:
        node["reservation_affinity"] = {
            "consume_reservation_type": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": [capacity.reservation],
        }
    return node


def tpu_pool_args(pool: TpuPoolArgs, cluster_name: pulumi.Input[str], policy_name: pulumi.Input[str] | None,
                  index: int = 0) -> dict:  # fmt: skip
    """Slice `index`'s node pool: placed on its own (COMPACT with the topology; on Ironwood the workload
    policy, which every slice's pool shares, as xpk's node-pool creation passes one --placement-policy to
    each of its --num-slices pools: AI-Hypercomputer/xpk src/xpk/core/nodepool.py)."""
    placement = {"type": pool.tpu.generation.placement_type, "tpu_topology": pool.tpu.topology}
    if pool.tpu.generation.uses_workload_policy:
        placement["policy_name"] = policy_name
    args = {
        "name": tpu_pool_name(index),
        "project": pool.project,
        "cluster": cluster_name,
        "location": pool.zone,
        **pool_size(pool),
        "node_config": tpu_node_config(pool),
        "placement_policy": placement,
    }
    if pool.capacity.flex_start:
        # flex-start nodes are not repaired, GKE refuses auto-repair on their pools (cluster-toolkit's
        # tpu7x flex-start blueprint sets it off too); a node that fails is replaced by the next scale-up
        args["management"] = {"auto_repair": False, "auto_upgrade": True}
    return args


def pool_size(pool: TpuPoolArgs) -> dict:
    """A fixed slice (the walkthrough), or one that autoscales between none and one whole slice.

    Autoscaled: created empty, per-zone min/max (GKE rejects a multi-host TPU pool given only
    the total_* fields: "Maximum node count 0 is not a valid size of TPU pod slice",
    vllm-project/ci-infra), and the one zone; GKE adds or removes the slice's hosts together.
    """
    if not pool.capacity.scale_to_zero:
        return {"node_count": pool.tpu.hosts}
    return {
        "initial_node_count": 0,
        "autoscaling": {"min_node_count": 0, "max_node_count": pool.tpu.hosts, "location_policy": "ANY"},
        "node_locations": [pool.zone],
    }


@dataclass(frozen=True, kw_only=True)
class GkeClusterArgs:
    cluster: ClusterArgs
    pool: TpuPoolArgs | None  # None in Autopilot


class GkeCluster(pulumi.ComponentResource):
    """The cluster; in Standard mode also a TPU node pool per slice (and Ironwood's workload policy)."""

    def __init__(self, name: str, args: GkeClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:GkeCluster", name, None, opts)
        cluster, pool = args.cluster, args.pool
        child = pulumi.ResourceOptions(parent=self)
        self.cluster = gcp.container.Cluster(
            name,
            **cluster_args(cluster),
            opts=child.merge(pulumi.ResourceOptions(custom_timeouts=pulumi.CustomTimeouts(create="45m"))),
        )
        self.tpu_pools: list[gcp.container.NodePool] = []
        if pool is not None:
            policy_name = None
            if pool.tpu.generation.uses_workload_policy:
                policy_args = workload_policy_args(cluster.name, pool)
                policy_name = gcp.compute.ResourcePolicy(f"{name}-workload-policy", **policy_args, opts=child).name
            opts = child.merge(
                pulumi.ResourceOptions(
                    custom_timeouts=pulumi.CustomTimeouts(create="60m"),
                    # the autoscaler owns the node count; Pulumi must not set it back
                    ignore_changes=["nodeCount"] if pool.capacity.scale_to_zero else None,
                )
            )
            self.tpu_pools = [
                # (the first keeps its Pulumi name too: a one-slice stack's pool is never replaced)
                gcp.container.NodePool(f"{name}-tpu" + (f"-{i + 1}" if i else ""),
                                       **tpu_pool_args(pool, self.cluster.name, policy_name, i), opts=opts)
                for i in range(pool.num_slices)
            ]  # fmt: skip
        self.name = self.cluster.name
        self.endpoint = self.cluster.endpoint
        self.ca_certificate = self.cluster.master_auth.cluster_ca_certificate
        self.register_outputs({"name": self.name, "endpoint": self.endpoint})
