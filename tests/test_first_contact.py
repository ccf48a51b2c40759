"""Where the stack meets GKE and KubeRay, checked against what their sources say: the pods run as the
ServiceAccount the bucket is granted to; Spot pools give the pods the grace their preStop drain is sized to;
the Ironwood group's TPU resource reaches every KubeRay (v1.4.2's CRD and v1.7.0's, strictly); no TorchTPU
setting that no release reads."""

from __future__ import annotations

import json

import pytest

from infra.resources.raycluster import ray_cluster_manifest
from tests.crd_schema import load_schema, validate
from tests.schemas import KUBERAY_TAGS as KUBERAY
from tests.schemas import schema_file
from tests.stack_harness import PROJECT_NUMBER, parse_as_cli, run_program, stack_config
from tests.test_raycluster import IMAGE, cfg_for

STACKS, MODES = ("v6e", "tpu7x"), ("standard", "autopilot")


def pod_specs(run) -> list[dict]:
    spec = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]


@pytest.mark.parametrize("account", ["default", "ray-pods"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stack", STACKS)
def test_the_pods_run_as_the_serviceaccount_the_bucket_is_granted_to(stack, mode, account):
    run = run_program(stack, stack_config(stack, mode=mode, serviceAccount=account, namespace="ml"))
    member = run.one("gcp:storage/bucketIAMMember:BucketIAMMember").inputs["member"]
    assert member == (f"principal://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/"
                      f"workloadIdentityPools/demo-project.svc.id.goog/subject/ns/ml/sa/{account}")  # fmt: skip
    assert [spec["serviceAccountName"] for spec in pod_specs(run)] == [account, account]
    created = {r.type: r.inputs["metadata"] for r in run.resources if r.type.startswith("kubernetes:core/v1:")}
    assert created.pop("kubernetes:core/v1:Namespace") == {"name": "ml"}
    assert created.pop("kubernetes:core/v1:Secret")["namespace"] == "ml"
    expected = (
        {} if account == "default" else {"kubernetes:core/v1:ServiceAccount": {"name": account, "namespace": "ml"}}
    )
    assert created == expected  # `default` exists in every namespace
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    assert training["identity"] == {"namespace": "ml", "service_account": account, "principal": member,
                                    "bucket": f"demo-project-{stack}-checkpoints"}  # fmt: skip


def test_the_walkthrough_namespace_and_account_create_nothing():
    run = run_program("v6e", stack_config("v6e"))
    assert {r.type for r in run.resources if r.type.startswith("kubernetes:core/v1:")} == {"kubernetes:core/v1:Secret"}


def worker_spec(run) -> dict:
    return run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def drain_seconds(spec: dict) -> int:
    return int(spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1])


@pytest.mark.parametrize("stack", STACKS)
def test_a_standard_spot_pool_raises_the_kubelets_grace_and_the_pods_use_what_it_gives(stack):
    """GKE gives a Spot VM 30 s and its pods 15 s unless the pool's kubelet is told 120 s (15 of them for
    critical pods): the pods get 105 s, and their preStop drain ends 15 s before that."""
    run = run_program(stack, stack_config(stack, capacity="spot"))
    kubelet = run.one("gcp:container/nodePool:NodePool").inputs["nodeConfig"]["kubeletConfig"]
    assert kubelet == {"shutdownGracePeriodSeconds": 120, "shutdownGracePeriodCriticalPodsSeconds": 15}
    import pulumi_gcp as gcp

    gcp.container.NodePoolNodeConfigKubeletConfigArgs(shutdown_grace_period_seconds=120,
                                                      shutdown_grace_period_critical_pods_seconds=15)  # fmt: skip
    spec = worker_spec(run)
    grace = spec["terminationGracePeriodSeconds"]
    assert grace == kubelet["shutdownGracePeriodSeconds"] - kubelet["shutdownGracePeriodCriticalPodsSeconds"] == 105
    assert drain_seconds(spec) == 90


@pytest.mark.parametrize("capacity,mode,grace", [("spot", "autopilot", 25), ("onDemand", "standard", 120),
                                                 ("flexStart", "standard", 120), ("onDemand", "autopilot", 120)])  # fmt: skip
def test_each_capacity_kind_sizes_the_pods_grace_to_what_gke_grants(capacity, mode, grace):
    run = run_program("v6e", stack_config("v6e", mode=mode, capacity=capacity))
    spec = worker_spec(run)
    assert spec["terminationGracePeriodSeconds"] == grace and drain_seconds(spec) == grace - 15
    pools = run.of_type("gcp:container/nodePool:NodePool")
    assert all("kubeletConfig" not in pool.inputs["nodeConfig"] for pool in pools)


def test_spot_on_a_control_plane_too_old_for_its_grace_is_refused():
    from infra.config.stack import ConfigError

    with pytest.raises(ConfigError, match=r"clusterVersion: '1.34' cannot give Spot pods more than 15 s.*"
                                          r"1\.35\.0-gke\.1171000"):  # fmt: skip
        parse_as_cli({"capacity": "spot", "clusterVersion": "1.34"})
    assert parse_as_cli({"capacity": "spot", "clusterVersion": "1.35"}).capacity.spot
    assert parse_as_cli({"capacity": "spot", "clusterVersion": "1.34", "mode": "autopilot"}, region="us-east5")


def test_the_pods_prestop_hook_drains_their_ray_node():
    from infra.resources import stop_hook

    spec = worker_spec(run_program("tpu7x", stack_config("tpu7x")))
    command = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command == stop_hook.command(105)
    assert "drain-node" in command[2] and "DRAIN_NODE_REASON_PREEMPTION" in command[2]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "5"


def test_the_drain_uses_the_flags_of_the_pinned_ray_cli():
    """`ray drain-node`'s options in the installed Ray (2.60): the hook's every flag, and its reason."""
    from click.testing import CliRunner
    from ray.scripts.scripts import cli

    from infra.resources import stop_hook

    help_text = CliRunner().invoke(cli, ["drain-node", "--help"]).output
    for flag in ("--address", "--node-id", "--reason", "--reason-message", "--deadline-remaining-seconds"):
        assert flag in help_text
    assert stop_hook.REASON in help_text


@pytest.fixture(scope="module", params=list(KUBERAY))
def kuberay(request):
    return request.param, load_schema(schema_file(f"rayclusters {request.param}"))


@pytest.mark.parametrize("extra", [{}, {"capacity": "spot"}, {"mode": "autopilot"}, {"numSlices": "2"},
                                   {"serviceAccount": "ray-pods", "namespace": "ml"}])  # fmt: skip
@pytest.mark.parametrize("stack", STACKS)
def test_the_ray_cluster_is_valid_for_every_kuberay(kuberay, stack, extra):
    """Strictly against v1.7.0's CRD and v1.4.2's (before `workerGroupSpecs[].resources` existed); and never
    both `resources` and rayStartParams' resources in a group, which v1.7.0 refuses
    (ray-operator/controllers/ray/utils/validation.go, validateRayGroupResources)."""
    version, schema = kuberay
    cfg = cfg_for(*("v6e", "4x4") if stack == "v6e" else ("tpu7x", "2x2x2"), **extra)
    manifest = ray_cluster_manifest(cfg, IMAGE)
    assert validate(manifest, schema) == [], version
    for group in [manifest["spec"]["headGroupSpec"], *manifest["spec"]["workerGroupSpecs"]]:
        assert "resources" not in group


def test_ironwood_advertises_its_chiplets_where_every_kuberay_reads_them():
    """The walkthrough's `resources: {TPU: "8"}`, as rayStartParams: the form KubeRay writes itself, which its
    parser (pod.go getResourcesMap: quotes trimmed, then JSON) and Ray's autoscaler (_get_custom_resources:
    the outer pair dropped, then JSON, values integers) both read, and bash unquotes in `ray start`."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    group = ray_cluster_manifest(cfg_for("tpu7x", "2x2x2"), IMAGE)["spec"]["workerGroupSpecs"][0]
    value = group["rayStartParams"]["resources"]
    assert json.loads(value.strip("'\"` ")) == {"TPU": 8}
    assert _get_custom_resources({}, group["rayStartParams"], group["groupName"]) == {"TPU": 8}
    v6e = ray_cluster_manifest(cfg_for("v6e", "4x4"), IMAGE)["spec"]["workerGroupSpecs"][0]
    assert v6e["rayStartParams"] == {}  # KubeRay counts google.com/tpu's 4 chips: 4 devices


def test_no_torch_tpu_setting_that_no_release_reads():
    """torch-tpu 0.2.0's libraries read TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT; no INTERNAL name of it."""
    manifest = ray_cluster_manifest(cfg_for("tpu7x", "2x2x2", bucketName="bkt-1"), IMAGE)
    text = json.dumps(manifest)
    assert "TORCH_TPU_INTERNAL_" not in text and "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT" in text
