"""The RayCluster manifest: equal to the walkthrough's, and valid against KubeRay's CRD."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest

from infra.resources.raycluster import RayClusterSpec, ray_cluster_manifest
from tests.crd_schema import load_schema, validate
from tests.schemas import schema_file
from tests.stack_harness import parse_as_cli

IMAGE = "us-east5-docker.pkg.dev/p/ray-torchtpu/ray-torchtpu@sha256:" + "cd" * 32
TOKEN_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-secret", "key": "hf_api_token"}}}


def cfg_for(generation: str, topology: str, **raw) -> RayClusterSpec:
    """The RayCluster's spec as __main__.py gives it from the stack's config."""
    cfg = parse_as_cli({"tpuGeneration": generation, "tpuTopology": topology, **raw}, stack="t", region="us-east5")
    return RayClusterSpec(name=cfg.ray_cluster_name, namespace=cfg.namespace, tpu=cfg.slice, capacity=cfg.capacity,
                          autopilot=cfg.autopilot, head_cpus=cfg.head_cpus, num_slices=cfg.num_slices,
                          defer_and_fuse=cfg.defer_and_fuse, compile_cache=cfg.compile_cache_root,
                          service_account=cfg.service_account)  # fmt: skip


STOP_HOOK_SOURCE = (Path(__file__).resolve().parent.parent / "infra" / "resources" / "stop_hook.py").read_text()


def walkthrough_manifest(group, hosts, memory, shm, accelerator, topology, ironwood):
    """The walkthrough's RayCluster for one flavour, written out by hand from SPEC.md."""
    extra_env = [{"name": "RAY_TPU_RESOURCE_PER_CHIP", "value": "2"}] if ironwood else []
    worker_resources = {"cpu": "64", "memory": memory, "google.com/tpu": "4"}
    worker = {
        "groupName": group,
        "replicas": 1,
        "numOfHosts": hosts,
        # the walkthrough's group-level `resources: {TPU: "8"}`, where every KubeRay reads it
        "rayStartParams": {"resources": """'{"TPU":8}'"""} if ironwood else {},
        "template": {
            "spec": {
                "serviceAccountName": "default",
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": IMAGE,
                        # beyond the walkthrough: `ray start`, sent SIGTERM after the drain, stops within 5 s
                        "env": [TOKEN_ENV, *extra_env, {"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": "5"}],
                        "resources": {"requests": worker_resources, "limits": worker_resources},
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                        # beyond the walkthrough: the pod's Ray node is drained (a 105 s deadline) before it goes
                        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", STOP_HOOK_SOURCE, "105"]}}},
                    }
                ],
                "terminationGracePeriodSeconds": 120,
                "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}],
                "nodeSelector": {
                    "cloud.google.com/gke-tpu-accelerator": accelerator,
                    "cloud.google.com/gke-tpu-topology": topology,
                },
            }
        },
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "ray-torchtpu-cluster", "namespace": "default"},
        "spec": {
            "rayVersion": "2.60.0",  # beyond the walkthrough: KubeRay is told the image's Ray (image/requirements.txt)
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": "0"},
                "template": {
                    "spec": {
                        "serviceAccountName": "default",
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": IMAGE,
                                "ports": [
                                    {"containerPort": 6379, "name": "gcs"},
                                    {"containerPort": 8265, "name": "dashboard"},
                                    {"containerPort": 10001, "name": "client"},
                                ],
                                "env": [TOKEN_ENV, *extra_env],
                                "resources": {
                                    "requests": {"cpu": "4", "memory": "16Gi"},
                                    "limits": {"cpu": "4", "memory": "16Gi"},
                                },
                            }
                        ],
                    }
                },
            },
            "workerGroupSpecs": [worker],
        },
    }


# the walkthrough's slice, up from `up` to `destroy`, its head, which runs no Ray work, and TorchTPU's defaults
ALWAYS_ON = {"scaleToZero": "false", "headCpus": "0", "deferAndFuse": "false", "compileCache": "false"}
FLAVOURS = {
    "v6e": (
        cfg_for("v6e", "4x4", **ALWAYS_ON),
        walkthrough_manifest("v6e-16", 4, "200Gi", "100Gi", "tpu-v6e-slice", "4x4", False),
    ),
    "tpu7x": (
        cfg_for("tpu7x", "2x2x2", **ALWAYS_ON),
        walkthrough_manifest("tpu7x-16", 2, "250Gi", "128Gi", "tpu7x", "2x2x2", True),
    ),
}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_manifest_equals_walkthrough(flavour):
    cfg, expected = FLAVOURS[flavour]
    assert ray_cluster_manifest(cfg, IMAGE) == expected


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_scale_to_zero_leaves_the_replicas_to_the_job_resource(flavour):
    """By default the worker group is bounded 0..1 and its replicas are not declared at all: the CRD
    makes them 0 at creation, and no later `up` can set them back under a running job."""
    cfg, walkthrough = FLAVOURS[flavour]
    default = ray_cluster_manifest(replace(cfg, capacity=replace(cfg.capacity, scale_to_zero=True)), IMAGE)
    group = default["spec"]["workerGroupSpecs"][0]
    assert "replicas" not in group and (group["minReplicas"], group["maxReplicas"]) == (0, 1)
    expected = copy.deepcopy(walkthrough)
    expected_group = expected["spec"]["workerGroupSpecs"][0]
    del expected_group["replicas"]
    expected_group.update(minReplicas=0, maxReplicas=1)
    assert default == expected


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_by_default_the_head_offers_three_cpus_to_the_data_preparation(flavour):
    """The walkthrough's head runs no Ray work (num-cpus 0); by default three of its four CPUs prepare the
    data (jobs/data/prepared.py) before the slice is asked for. Nothing else in the manifest changes."""
    cfg, walkthrough = FLAVOURS[flavour]
    assert parse_as_cli({}).head_cpus == 3
    expected = copy.deepcopy(walkthrough)
    expected["spec"]["headGroupSpec"]["rayStartParams"] = {"num-cpus": "3"}
    assert ray_cluster_manifest(replace(cfg, head_cpus=3), IMAGE) == expected


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_slices_are_two_replicas_of_the_group_and_torch_tpu_settings_reach_only_the_tpu_workers(flavour):
    """A replica of the TPU worker group is one slice of numOfHosts pods; scaled to zero, the group is bounded
    0..2. TORCH_TPU_DEFER_AND_FUSE and the compile cache in the bucket are on by default, on the workers only."""
    cfg, walkthrough = FLAVOURS[flavour]
    topology = cfg.tpu.topology
    two = cfg_for(cfg.tpu.generation.name, topology, **ALWAYS_ON, numSlices="2")
    expected = copy.deepcopy(walkthrough)
    expected["spec"]["workerGroupSpecs"][0]["replicas"] = 2
    assert ray_cluster_manifest(two, IMAGE) == expected
    scaled = ray_cluster_manifest(replace(two, capacity=replace(two.capacity, scale_to_zero=True)), IMAGE)
    group = scaled["spec"]["workerGroupSpecs"][0]
    assert "replicas" not in group and (group["minReplicas"], group["maxReplicas"]) == (0, 2)

    default = ray_cluster_manifest(cfg_for(cfg.tpu.generation.name, topology, bucketName="bkt-1"), IMAGE)
    worker_env = default["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    walkthrough_env = walkthrough["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert worker_env == walkthrough_env[:-1] + [
        {"name": "TORCH_TPU_DEFER_AND_FUSE", "value": "1"},
        {"name": "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "value": "gs://bkt-1/torch_tpu_compile_cache"},
        walkthrough_env[-1],
    ]
    head_env = default["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert head_env == walkthrough["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]


def test_ray_version_is_the_image_pin_and_the_local_one():
    import re

    from infra import ROOT
    from infra.resources.raycluster import ray_version

    local = re.search(r"^ray\[[a-z,]+\]==(\S+)$", (ROOT / "requirements.txt").read_text(), re.MULTILINE).group(1)
    assert ray_version() == local == "2.60.0"


@pytest.fixture(scope="module")
def schema():
    return load_schema(schema_file("rayclusters v1.7.0"))


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize(
    "extra",
    [
        {},
        ALWAYS_ON,
        {"mode": "autopilot", "spot": "true"},
        {"mode": "autopilot", "reservation": "r1"},
        {"numSlices": "2"},
    ],
)
def test_manifest_passes_strict_crd_validation(schema, flavour, extra):
    cfg = cfg_for(*("v6e", "4x4") if flavour == "v6e" else ("tpu7x", "2x2x2"), **extra)
    assert validate(ray_cluster_manifest(cfg, IMAGE), schema) == []


def test_the_crd_defaults_undeclared_replicas_to_zero(schema):
    group_schema = schema["properties"]["spec"]["properties"]["workerGroupSpecs"]["items"]
    assert group_schema["properties"]["replicas"]["default"] == 0


def _broken(mutate):
    manifest = copy.deepcopy(FLAVOURS["v6e"][1])
    mutate(manifest)
    return manifest


BROKEN = {
    "typo'd field": (lambda m: m["spec"]["workerGroupSpecs"][0].update(numOfHost=4), "numOfHost: unknown field"),
    "typo in pod spec": (
        lambda m: m["spec"]["headGroupSpec"]["template"]["spec"].update(nodeSelecter={}),
        "nodeSelecter: unknown field",
    ),
    "wrong type": (lambda m: m["spec"]["workerGroupSpecs"][0].update(replicas="1"), "replicas: expected integer"),
    "port as string": (
        lambda m: m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0].update(
            containerPort="6379"
        ),
        "containerPort: expected integer",
    ),
    "missing required": (
        lambda m: m["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop("name"),
        "missing required field 'name'",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_validator_bites(schema, case):
    mutate, message = BROKEN[case]
    errors = validate(_broken(mutate), schema)
    assert any(message in e for e in errors), errors


def test_defaults_are_applied_before_required_is_checked():
    schema = {
        "type": "object",
        "properties": {
            "spec": {"type": "object", "required": ["mode"], "properties": {"mode": {"type": "string", "default": "a"}}}
        },
    }
    assert validate({"spec": {}}, schema) == []
    del schema["properties"]["spec"]["properties"]["mode"]["default"]
    assert validate({"spec": {}}, schema) == [".spec: missing required field 'mode'"]
