"""The GKE cluster with the Ray Operator add-on, and in Standard mode its TPU slice node pool."""

from __future__ import annotations

import pulumi
import pulumi_gcp as gcp

from infra import PROJECT
from infra.config import StackConfig, flex_start_run_minutes

TPU_POOL_NAME = "tpu-multi-host-pool"


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


def cluster_args(cfg: StackConfig) -> dict:
    """Inputs of the container.Cluster for the chosen mode."""
    common = {
        "name": cfg.cluster_name,
        "project": cfg.project,
        "location": cfg.location,
        "min_master_version": cfg.cluster_version,
        "deletion_protection": cfg.deletion_protection,
        "addons_config": ray_addon(),
    }
    if cfg.autopilot:
        # Autopilot brings Workload Identity, Dataplane V2 and image streaming itself.
        return common | {"enable_autopilot": True}
    standard = {
        "initial_node_count": 1,
        "node_config": {
            "machine_type": cfg.head_machine_type,
            "gcfs_config": {"enabled": True},
            "workload_metadata_config": {"mode": "GKE_METADATA"},
        },
        "datapath_provider": "ADVANCED_DATAPATH",
        "workload_identity_config": {"workload_pool": f"{cfg.project}.svc.id.goog"},
    }
    if cfg.scale_to_zero:
        # The autoscaler profile that removes idle nodes sooner; `enabled` is node auto-provisioning, off.
        standard["cluster_autoscaling"] = {"enabled": False, "autoscaling_profile": "OPTIMIZE_UTILIZATION"}
    return common | standard


def workload_policy_args(cfg: StackConfig) -> dict:
    return {
        "name": f"{cfg.cluster_name}-placement",
        "project": cfg.project,
        "region": cfg.region,
        "workload_policy": {"type": "HIGH_THROUGHPUT", "accelerator_topology": cfg.slice.topology},
    }


def tpu_node_config(cfg: StackConfig) -> dict:
    node = {
        "machine_type": cfg.slice.generation.machine_type,
        "workload_metadata_config": {"mode": "GKE_METADATA"},
        "gcfs_config": {"enabled": True},
    }
    if cfg.spot:
        node["spot"] = True
    if cfg.capacity == "flexStart":
        # Dynamic Workload Scheduler: GKE gets the capacity when the slice is asked for, and the nodes
        # run at most this long (provisioning, then the collectives check and the fine-tune).
        minutes = flex_start_run_minutes(cfg.job.timeout_minutes, cfg.slice_ready_timeout_minutes)
        node |= {"flex_start": True, "max_run_duration": f"{minutes * 60}s"}
    if cfg.reservation:
        node["reservation_affinity"] = {
            "consume_reservation_type": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": [cfg.reservation],
        }
    return node


def tpu_pool_args(cfg: StackConfig, cluster_name: pulumi.Input[str], policy_name: pulumi.Input[str] | None) -> dict:
    placement = {"type": cfg.slice.generation.placement_type, "tpu_topology": cfg.slice.topology}
    if cfg.slice.generation.uses_workload_policy:
        placement["policy_name"] = policy_name
    args = {
        "name": TPU_POOL_NAME,
        "project": cfg.project,
        "cluster": cluster_name,
        "location": cfg.location,
        **pool_size(cfg),
        "node_config": tpu_node_config(cfg),
        "placement_policy": placement,
    }
    if cfg.capacity == "flexStart":
        # flex-start nodes are not repaired, GKE refuses auto-repair on their pools (cluster-toolkit's
        # tpu7x flex-start blueprint sets it off too); a node that fails is replaced by the next scale-up
        args["management"] = {"auto_repair": False, "auto_upgrade": True}
    return args


def pool_size(cfg: StackConfig) -> dict:
    """A fixed slice (the walkthrough), or one that autoscales between none and one whole slice.

    Autoscaled: created empty, per-zone min/max (GKE rejects a multi-host TPU pool given only
    the total_* fields: "Maximum node count 0 is not a valid size of TPU pod slice",
    vllm-project/ci-infra), and the one zone; GKE adds or removes the slice's hosts together.
    """
    if not cfg.scale_to_zero:
        return {"node_count": cfg.slice.hosts}
    return {
        "initial_node_count": 0,
        "autoscaling": {"min_node_count": 0, "max_node_count": cfg.slice.hosts, "location_policy": "ANY"},
        "node_locations": [cfg.zone],
    }


class GkeCluster(pulumi.ComponentResource):
    """The cluster; in Standard mode also the TPU slice node pool (and Ironwood's workload policy)."""

    def __init__(self, name: str, cfg: StackConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:GkeCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.cluster = gcp.container.Cluster(
            name,
            **cluster_args(cfg),
            opts=child.merge(pulumi.ResourceOptions(custom_timeouts=pulumi.CustomTimeouts(create="45m"))),
        )
        self.tpu_pool = None
        if not cfg.autopilot:
            policy_name = None
            if cfg.slice.generation.uses_workload_policy:
                policy = gcp.compute.ResourcePolicy(f"{name}-workload-policy", **workload_policy_args(cfg), opts=child)
                policy_name = policy.name
            self.tpu_pool = gcp.container.NodePool(
                f"{name}-tpu",
                **tpu_pool_args(cfg, self.cluster.name, policy_name),
                opts=child.merge(
                    pulumi.ResourceOptions(
                        custom_timeouts=pulumi.CustomTimeouts(create="60m"),
                        # the autoscaler owns the node count; Pulumi must not set it back
                        ignore_changes=["nodeCount"] if cfg.scale_to_zero else None,
                    )
                ),
            )
        self.name = self.cluster.name
        self.endpoint = self.cluster.endpoint
        self.ca_certificate = self.cluster.master_auth.cluster_ca_certificate
        self.register_outputs({"name": self.name, "endpoint": self.endpoint})
