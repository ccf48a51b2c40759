"""numSlices on both stacks under mocks: a node pool per slice, a worker-group replica per slice, the jobs
told, the price per hour counting every slice; and the key's checks."""

from __future__ import annotations

import pytest

from tests.stack_harness import parse_as_cli, run_program, stack_config

HOSTS = {"v6e": 4, "tpu7x": 2}


def snake_case(node: dict) -> dict:
    import re

    return {re.sub(r"([A-Z])", r"_\1", k).lower(): v for k, v in node.items()}


def known_to_pulumi_gcp(args_class, inputs: dict, nested: dict) -> None:
    """Every input key is a field of the installed pulumi-gcp's Args class (a misspelt one raises), the
    nested blocks of `nested` (key -> Args class) too."""
    args_class(**snake_case(inputs))
    for key, cls in nested.items():
        if key in inputs:
            cls(**snake_case(inputs[key]))


@pytest.fixture(scope="module", params=["v6e", "tpu7x"])
def two(request):
    stack = request.param
    one_slice = run_program(stack, stack_config(stack, scaleToZero="false"))
    run = run_program(stack, stack_config(stack, numSlices="2", scaleToZero="false"))
    run.stack, run.one_slice = stack, one_slice
    return run


def test_standard_mode_makes_a_node_pool_per_slice_each_placed_as_a_slice(two):
    import pulumi_gcp as gcp

    pools = sorted(two.of_type("gcp:container/nodePool:NodePool"), key=lambda p: p.inputs["name"])
    assert [p.inputs["name"] for p in pools] == ["tpu-multi-host-pool", "tpu-multi-host-pool-2"]
    assert [p.name for p in pools] == [f"ray-tpu-{two.stack}-tpu", f"ray-tpu-{two.stack}-tpu-2"]
    policies = two.of_type("gcp:compute/resourcePolicy:ResourcePolicy")
    for pool in pools:
        inputs = pool.inputs
        assert inputs["location"] == "us-east5-b" and inputs["nodeCount"] == HOSTS[two.stack]
        if two.stack == "v6e":
            assert policies == [] and inputs["placementPolicy"] == {"type": "COMPACT", "tpuTopology": "4x4"}
        else:  # one workload policy, which each slice's pool names (as xpk does for its --num-slices pools)
            (policy,) = policies
            assert inputs["placementPolicy"] == {
                "type": "",
                "policyName": policy.inputs["name"],
                "tpuTopology": "2x2x2",
            }
            known_to_pulumi_gcp(gcp.compute.ResourcePolicyArgs, policy.inputs,
                                {"workloadPolicy": gcp.compute.ResourcePolicyWorkloadPolicyArgs})  # fmt: skip
        known_to_pulumi_gcp(gcp.container.NodePoolArgs, inputs, {
            "nodeConfig": gcp.container.NodePoolNodeConfigArgs,
            "placementPolicy": gcp.container.NodePoolPlacementPolicyArgs,
            "autoscaling": gcp.container.NodePoolAutoscalingArgs,
            "management": gcp.container.NodePoolManagementArgs,
        })  # fmt: skip
    first = two.one_slice.one("gcp:container/nodePool:NodePool").inputs
    assert pools[0].inputs == first  # the first slice's pool is the one-slice stack's, unchanged
    assert pools[1].inputs == first | {"name": "tpu-multi-host-pool-2"}  # and the second is the same slice again


def test_the_tpu_group_holds_a_replica_per_slice_and_the_jobs_are_told(two):
    from config.command_line import from_args, parse_args
    from infra.runner.ray_jobs import job_specs
    from ray_core_collectives import parse_args as collectives_args

    worker = two.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]
    assert worker["replicas"] == 2 and worker["numOfHosts"] == HOSTS[two.stack]
    training = two.one("pulumi-python:dynamic:Resource", "training").inputs
    assert training["settings"]["num_slices"] == 2
    collectives, finetune = job_specs(training["settings"], training["max_failures"])
    assert collectives_args(list(collectives.args)).num_slices == 2
    settings = from_args(parse_args(list(finetune.args)))
    assert (settings.num_slices, settings.topology) == (2, {"v6e": "4x4", "tpu7x": "2x2x2"}[two.stack])


def test_the_price_an_hour_counts_every_slice_and_the_memory_plan_one(two):
    cost, one = two.outputs["costEstimate"], two.one_slice.outputs["costEstimate"]
    assert cost["chips"] == 2 * one["chips"] and cost["slices"] == 2
    if one["usd_per_hour"] is not None:
        assert cost["usd_per_hour"] == pytest.approx(2 * one["usd_per_hour"])
        # twice the devices, the same work: data-parallel scaling halves the training minutes
        assert cost["training_minutes"][0] == pytest.approx(one["training_minutes"][0] / 2, abs=0.1)
        assert "data-parallel scaling" in cost["assumptions"]
    plan, one_plan = two.outputs["memoryPlan"], two.one_slice.outputs["memoryPlan"]
    assert plan == one_plan | {"slices": 2} and plan["devices"] == 16


@pytest.mark.parametrize("stack", ["v6e", "tpu7x"])
def test_scaled_to_zero_the_job_resource_asks_for_every_slice(stack):
    run = run_program(stack, stack_config(stack, numSlices="2"))
    worker = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]
    assert "replicas" not in worker and (worker["minReplicas"], worker["maxReplicas"]) == (0, 2)
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    assert (training["slice"]["replicas"], training["slice"]["hosts"]) == (2, 2 * HOSTS[stack])
    assert training["price"]["chips"] == 2 * {"v6e": 16, "tpu7x": 8}[stack] if training.get("price") else True
    for pool in run.of_type("gcp:container/nodePool:NodePool"):
        assert pool.inputs["autoscaling"]["maxNodeCount"] == HOSTS[stack]


def test_the_scaler_asks_for_every_slice_waits_for_every_host_and_counts_them_all():
    """Through the API server stand-in: one patch to 2 replicas, the wait until 2 x 4 hosts are Ready, the
    host-hours of all eight, and one patch back to 0."""
    from infra.runner import ray_jobs
    from infra.runner.resilience import FixedToken, RetryPolicy
    from infra.training import slice_settings
    from tests.apiserver_standin import FakeSlice, ServiceProxyStandin

    cfg = parse_as_cli({"numSlices": "2"})
    tpu = FakeSlice(cfg.ray_cluster_name, cfg.slice.worker_group, hosts=cfg.slice.hosts)
    logged: list[str] = []
    target = {"kind": "gke", "ca_certificate": None, "namespace": "default",
              "service": "ray-torchtpu-cluster-head-svc", "port": 8265}  # fmt: skip
    with ServiceProxyStandin("k8s-bearer", "default", target["service"], 8265, "http://127.0.0.1:9",
                             fake_slice=tpu) as proxy:  # fmt: skip
        tpu_props = slice_settings(cfg) | {"ready_timeout_s": 5}
        props = {"target": target | {"endpoint": proxy.url}, "slice": tpu_props, "poll_s": 0.01}
        scaler = ray_jobs.slice_scaler(props, FixedToken("k8s-bearer"), RetryPolicy(budget_s=5), logged.append)
        scaler.up()
        host_hours = scaler.down()
    assert tpu.patches == [2, 0]
    assert logged[0] == "TPU slice: scaling worker group v6e-16 to 2 (2 slices, 8 hosts)"
    assert "TPU slice: 4/8 hosts ready (GKE is adding nodes)" in logged and "TPU slice: 8/8 hosts ready" in logged
    assert host_hours > 0 and scaler.hosts == 8  # host-hours of all eight hosts


def test_autopilot_asks_for_the_slices_through_the_group_alone():
    run = run_program("v6e", stack_config("v6e", mode="autopilot", numSlices="3", scaleToZero="false"))
    assert run.of_type("gcp:container/nodePool:NodePool") == []
    assert run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]["replicas"] == 3


BAD = {
    "zero": ({"numSlices": "0"}, "gemma-tpu:numSlices: 0 must be at least 1"),
    "not a number": ({"numSlices": "two"}, "gemma-tpu:numSlices: 'two' is not an integer"),
    "a fraction": ({"numSlices": "1.5"}, "gemma-tpu:numSlices: '1.5' is not an integer"),
    "past a cluster's nodes": ({"numSlices": "1250"}, "gemma-tpu:numSlices: 1250 slices of v6e 4x4 are 5000 TPU "
                               "hosts, past GKE's 5000 nodes a cluster (one is the head's): at most 1249"),
    "local groups": ({"mode": "local", "numSlices": "3"}, "gemma-tpu:numSlices: 3 does not divide "
                     "gemma-tpu:finetuneWorkers 2"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_numslices_is_checked_naming_the_key(case):
    from infra.config.stack import ConfigError

    raw, message = BAD[case]
    with pytest.raises(ConfigError, match=None) as err:
        parse_as_cli(raw)
    assert message in str(err.value)
    assert parse_as_cli({"numSlices": "1249"}).num_slices == 1249


def test_ray_train_counts_as_many_slices_as_the_stack_declares(two, monkeypatch):
    """Ray 2.60's Train controller derives the slice count from the topology and the workers
    (ray.util.tpu.get_tpu_num_slices_for_workers), counting devices a chip from RAY_TPU_RESOURCE_PER_CHIP
    in its own process: the head's env must carry it on Ironwood, or 32 workers on 2x2x2 would be 4 slices."""
    from ray.util.tpu import get_tpu_num_slices_for_workers

    from config.setting_checks import worker_count
    from config.settings import from_dict

    spec = two.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]
    head_env = {e["name"]: e.get("value") for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    if "RAY_TPU_RESOURCE_PER_CHIP" in head_env:
        monkeypatch.setenv("RAY_TPU_RESOURCE_PER_CHIP", head_env["RAY_TPU_RESOURCE_PER_CHIP"])
    settings = two.one("pulumi-python:dynamic:Resource", "training").inputs["settings"]
    topology, accelerator = settings["topology"], settings["accelerator_type"]
    workers = worker_count(from_dict(settings))
    assert workers == 32
    assert get_tpu_num_slices_for_workers(topology, accelerator, workers, {"TPU": 1}) == 2
