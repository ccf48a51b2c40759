"""Serving (issue 45) at preview: the serving pool, the RayService and its Serve application, whole and valid against
both KubeRay CRDs, KubeRay's webhook rules and Ray's own models; private; on the export's path; the image's vLLM TPU;
the serving memory plan and price; every bad value refused by name before any resource."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import yaml

from infra.config.stack import ConfigError
from tests.crd_schema import load_schema, validate
from tests.schemas import KUBERAY_TAGS as KUBERAY
from tests.schemas import schema_file
from tests.stack_harness import DIGEST, ROOT, run_program, stack_config

RAY_SERVICE, DYNAMIC, POOL = (
    "kubernetes:ray.io/v1:RayService",
    "pulumi-python:dynamic:Resource",
    "gcp:container/nodePool:NodePool",
)
TOKEN_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-secret", "key": "hf_api_token"}}}
SERVE_IMAGE = "us-east5-docker.pkg.dev/demo-project/ray-torchtpu/ray-torchtpu-serve@" + DIGEST


def served(stack: str = "v6e", **keys: str):
    """The program's run with `serve: finetuned` and `keys`, once a process for the same keys (the Run is read only)."""
    return _served(stack, tuple(sorted(keys.items())))


@functools.cache
def _served(stack: str, keys: tuple) -> object:
    return run_program(stack, stack_config(stack, **({"serve": "finetuned"} | dict(keys))))


@functools.cache
def schema(version: str) -> dict:
    return load_schema(schema_file(f"rayservices {version}"))


def config_of(stack: str = "v6e", **keys: str):
    """The stack's parsed config for `served(stack, **keys)`, as the program reads it."""
    from infra.config import stack as config

    raw = {k.split(":", 1)[1]: v for k, v in stack_config(stack, **({"serve": "finetuned"} | keys)).items()
           if k.startswith("gemma-tpu:") and k != "gemma-tpu:hfToken"}  # fmt: skip
    return config.parse(raw, stack=stack, project="demo-project", region="us-east5", zone="us-east5-b", has_token=True)


def export_of(run) -> str:
    """The job resource's `checkpoint` (the mocks' export path), which the endpoint must serve."""
    return run.outputs["checkpoint"]


def test_the_ray_service_whole_on_v6e():
    """The default `serve: finetuned` on the v6e stack: E2B on one v6e chip, 0 to 1 replicas, the export from the
    bucket, the text model's architecture, bf16 with tpu-inference CI's memory share for E4B."""
    run = served()
    manifest = run.one(RAY_SERVICE)
    spec = dict(manifest.inputs["spec"])  # (a copy: the Run is shared)
    app = yaml.safe_load(spec.pop("serveConfigV2"))
    assert app == {
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "applications": [{
            "name": "llm", "route_prefix": "/", "import_path": "ray.serve.llm:build_openai_app",
            "args": {"llm_configs": [{
                "model_loading_config": {"model_id": "gemma-4-E2B-it-finetuned", "model_source": export_of(run)},
                "deployment_config": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 1,
                                                             "downscale_delay_s": 600}},
                "engine_kwargs": {"max_model_len": 4096, "hf_overrides": {"architectures": ["Gemma4ForCausalLM"]},
                                  "dtype": "bfloat16", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.85},
                "accelerator_type": "TPU-V6E",
                "placement_group_config": {"bundles": [{"TPU": 1}], "strategy": "STRICT_PACK"},
            }]},
        }],
    }  # fmt: skip
    worker_resources = {"cpu": "16", "memory": "50Gi", "google.com/tpu": "1"}
    head_resources = {"cpu": "2", "memory": "6Gi"}
    assert manifest.inputs["metadata"] == {"name": "ray-torchtpu-cluster-llm", "namespace": "default"}
    assert spec == {"upgradeStrategy": {"type": "None"}, "rayClusterConfig": {
        "rayVersion": "2.60.0",
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"idleTimeoutSeconds": 600},
        "headGroupSpec": {
            "rayStartParams": {"num-cpus": "2"},
            "template": {"spec": {"serviceAccountName": "default", "containers": [{
                "name": "ray-head", "image": SERVE_IMAGE,
                "ports": [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                          {"containerPort": 10001, "name": "client"}, {"containerPort": 8000, "name": "serve"}],
                "env": [TOKEN_ENV], "resources": {"requests": head_resources, "limits": head_resources}}]}},
        },
        "workerGroupSpecs": [{
            "groupName": "v6e-serve-1", "replicas": 0, "minReplicas": 0, "maxReplicas": 1, "numOfHosts": 1,
            "rayStartParams": {"resources": "'{\"accelerator_type:TPU-V6E\":1}'"},
            "template": {"spec": {
                "serviceAccountName": "default",
                "containers": [{"name": "ray-worker", "image": SERVE_IMAGE,
                                "env": [TOKEN_ENV, {"name": "VLLM_XLA_CACHE_PATH",
                                                    "value": "gs://demo-project-v6e-checkpoints/vllm_xla_cache"}],
                                "resources": {"requests": worker_resources, "limits": worker_resources}}],
                "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                 "cloud.google.com/gke-tpu-topology": "1x1"},
            }},
        }],
    }}  # fmt: skip


def kuberay_webhook_problems(manifest: dict) -> list[str]:
    """KubeRay v1.7.0's RayService checks (ray-operator/controllers/ray/utils/validation.go:
    ValidateRayServiceMetadata, ValidateRayServiceSpec, ValidateRayClusterSpec) that a schema cannot express."""
    problems, name, cluster = [], manifest["metadata"]["name"], manifest["spec"]["rayClusterConfig"]
    if len(name) > 47 or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        problems.append(f"name {name!r}: a DNS-1035 label of at most 47 characters")
    if not cluster["headGroupSpec"]["template"]["spec"]["containers"]:
        problems.append("head without a container")
    if "headService" in cluster["headGroupSpec"]:
        problems.append("headService's name must not be set")
    for group in cluster["workerGroupSpecs"]:
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31)
        if not group["template"]["spec"]["containers"] or low < 0 or high < 0 or low > high:
            problems.append(f"group {group['groupName']}: containers, 0 <= minReplicas <= maxReplicas")
        if not cluster.get("enableInTreeAutoscaling") and ("minReplicas" not in group or "maxReplicas" not in group):
            problems.append(f"group {group['groupName']}: min and max replicas without autoscaling")
        if "resources" in group and "resources" in group.get("rayStartParams", {}):
            problems.append(f"group {group['groupName']}: resources twice")
    return problems


def as_manifest(registered) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": registered.inputs["metadata"],
            "spec": registered.inputs["spec"]}  # fmt: skip


@pytest.mark.slow  # (KubeRay's CRDs and Serve's own config models: ~9 s for the first, most of it imports)
@pytest.mark.parametrize(
    "stack, keys",
    [("v6e", {}), ("tpu7x", {}), ("v6e", {"mode": "autopilot", "serveCapacity": "spot"}),
     ("tpu7x", {"serveMinReplicas": "1", "serveReplicas": "3", "serve": "base"}),
     ("v6e", {"model": "google/gemma-4-31B-it", "activationCheckpointing": "true", "namespace": "ml",
             "serviceAccount": "ray-pods"})],
)  # fmt: skip
def test_the_ray_service_is_valid_for_every_kuberay_and_private(stack, keys):
    from infra.resources.serving import ray_service_manifest, serving_spec

    run, cfg = served(stack, **keys), config_of(stack, **keys)
    manifest = ray_service_manifest(serving_spec(cfg, cfg.serve_name), SERVE_IMAGE, "gs://bucket/run/model")
    registered = as_manifest(run.one(RAY_SERVICE))  # (the program's: numbers come back from the mocks as floats)
    assert {**manifest, "spec": {**manifest["spec"], "serveConfigV2": None}} == {
        **registered, "spec": {**registered["spec"], "serveConfigV2": None}}  # fmt: skip
    for version in KUBERAY:
        assert validate(manifest, schema(version)) == [], version
    assert kuberay_webhook_problems(manifest) == []
    # private: KubeRay's own ClusterIP Service, never one of another type, and nothing else exposes it
    assert "serveService" not in manifest["spec"] and "LoadBalancer" not in json.dumps(manifest)
    assert not run.of_type("kubernetes:core/v1:Service")
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    endpoint = run.outputs["endpoint"]
    assert endpoint["url"] == f"http://{name}-serve-svc.{namespace}.svc.cluster.local:8000/v1"
    assert endpoint["port_forward"] == f"kubectl -n {namespace} port-forward svc/{name}-serve-svc 8000:8000"
    # the kube context the port-forward needs, for a newcomer who has none (and the stack's own output of it)
    location = "us-east5" if keys.get("mode") == "autopilot" else "us-east5-b"
    assert endpoint["credentials"] == run.outputs["credentials"] == (
        f"gcloud container clusters get-credentials {run.outputs['clusterName']} --location {location} "
        "--project demo-project")  # fmt: skip
    request = json.loads(re.search(r"-d '(.*)'$", endpoint["curl"])[1])
    assert request["model"] == run.outputs["servedModel"] == endpoint["model"]
    assert endpoint["curl"].startswith("curl -s http://127.0.0.1:8000/v1/chat/completions ")


def test_the_serve_application_is_what_ray_serve_and_serve_llm_accept():
    """Ray 2.60.0's own models take what the stack writes: the Serve config (ServeDeploySchema), the LLMConfig (its
    TPU inference from accelerator_type, a single host: no topology), its placement group one bundle of the host's
    devices, as many as the host's worker advertises (Ironwood: 8 chiplets, with the chips' TPU resource per
    chiplet), beside the accelerator type the bundle asks for (tests/test_serving_first_contact.py places it with
    Ray's autoscaler)."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    for stack, devices, accelerator in (("v6e", 1, "TPU-V6E"), ("tpu7x", 8, "TPU-V7X")):
        spec = served(stack).one(RAY_SERVICE).inputs["spec"]
        config = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
        (app,) = config.applications
        llm = LLMConfig(**app.args["llm_configs"][0])
        assert llm.accelerator_config.kind == "tpu" and llm.accelerator_config.topology is None  # a single host
        assert llm.placement_group_config == {"bundles": [{"TPU": devices}], "strategy": "STRICT_PACK"}
        assert llm.engine_kwargs["tensor_parallel_size"] == devices
        worker = spec["rayClusterConfig"]["workerGroupSpecs"][0]
        advertised = json.loads(worker["rayStartParams"]["resources"].strip("'"))
        assert advertised == ({"TPU": devices} if devices > 1 else {}) | {f"accelerator_type:{accelerator}": 1}
        if devices > 1:
            env = worker["template"]["spec"]["containers"][0]["env"]
            assert {"name": "RAY_TPU_RESOURCE_PER_CHIP", "value": "2"} in env


def test_finetuned_serves_the_export_after_the_run_and_base_the_starting_model():
    run = served()
    source = yaml.safe_load(run.one(RAY_SERVICE).inputs["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert source["llm_configs"][0]["model_loading_config"]["model_source"] == export_of(run)
    base = served(serve="base")
    config = yaml.safe_load(base.one(RAY_SERVICE).inputs["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert config["llm_configs"][0]["model_loading_config"] == {"model_id": "gemma-4-E2B-it",
                                                                "model_source": "google/gemma-4-E2B-it"}  # fmt: skip
    # the RayService comes after the job resource (the export) and the training RayCluster (its Secret and CRD wait)
    waits_for = run.one(RAY_SERVICE).dependencies
    assert any(urn.endswith("::training") for urn in waits_for), waits_for
    assert run.outputs["servedModel"] == "gemma-4-E2B-it-finetuned" and base.outputs["servedModel"] == "gemma-4-E2B-it"


def test_serve_off_builds_no_serving_at_all():
    run = run_program("v6e", stack_config("v6e"))
    assert (
        not run.of_type(RAY_SERVICE) and "endpoint" not in run.outputs and "serving" not in run.outputs["costEstimate"]
    )
    assert [r.name for r in run.of_type("docker:index/image:Image")] == ["registry-image"]


def test_the_serving_pool_is_its_own_single_host_pool_scaled_from_zero():
    run = served(serveReplicas="2")
    pools = {p.name: p.inputs for p in run.of_type(POOL)}
    assert set(pools) == {"ray-tpu-v6e-tpu", "serving-tpu"}
    pool = pools["serving-tpu"]
    assert pool["nodeConfig"]["machineType"] == "ct6e-standard-1t" and "placementPolicy" not in pool
    assert pool["initialNodeCount"] == 0 and pool["autoscaling"]["minNodeCount"] == 0
    assert pool["autoscaling"]["maxNodeCount"] == 2 and "spot" not in pool["nodeConfig"]
    assert pools["ray-tpu-v6e-tpu"]["nodeConfig"]["machineType"] == "ct6e-standard-4t"  # the training slice's own
    assert served(serveCapacity="spot").one(POOL, "serving-tpu").inputs["nodeConfig"]["spot"] is True
    assert not served(mode="autopilot").of_type(POOL)  # Autopilot: the pods ask for the host
    images = {i.name: i.inputs for i in run.of_type("docker:index/image:Image")}
    assert images["registry-serve-image"]["build"]["context"].endswith("image/serve")


def test_the_serving_image_has_gemma4s_jax_path_and_the_vllm_rays_serve_llm_pins():
    from importlib.metadata import requires

    from infra.serving.app import MIN_TPU_INFERENCE, VLLM_TPU_VERSION

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    dockerfile = (ROOT / "image" / "serve" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=vllm/vllm-tpu:v(\S+)$", dockerfile, re.MULTILINE)[1]
    ray_pin = next(r for r in requires("ray") if r.startswith("vllm") and 'extra == "llm"' in r)
    assert base == VLLM_TPU_VERSION == re.search(r"==([\d.]+)", ray_pin)[1]
    assert version(base) >= version(MIN_TPU_INFERENCE) >= version("0.22.1")  # prompt logprobs, Gemma 4's JAX path
    serve_reqs = (ROOT / "image" / "serve" / "requirements.txt").read_text()
    train_reqs = (ROOT / "image" / "requirements.txt").read_text()
    pin = re.compile(r"^ray\[[a-z,]+\]==(\S+)$", re.MULTILINE)
    assert pin.search(serve_reqs)[1] == pin.search(train_reqs)[1]
    assert not re.search(r"^(vllm|ray\[[a-z,]*llm)", serve_reqs, re.MULTILINE)  # the CUDA vLLM never comes in


def test_the_serving_plan_picks_the_smallest_host_that_holds_each_size():
    from infra.cloud.models import smallest_serving_host
    from infra.job_modules import tpu_generations

    v6e, tpu7x = tpu_generations.GENERATIONS["v6e"], tpu_generations.GENERATIONS["tpu7x"]
    shapes = {size: smallest_serving_host(f"google/gemma-4-{size}-it", v6e, 4096).topology
              for size in ("E2B", "E4B", "26B-A4B", "31B")}  # fmt: skip
    assert shapes == {"E2B": "1x1", "E4B": "1x1", "26B-A4B": "2x2", "31B": "2x2"}
    assert smallest_serving_host("google/gemma-4-31B-it", v6e, 65_536) is None  # no v6e host at that length
    assert smallest_serving_host("google/gemma-4-31B-it", tpu7x, 65_536).topology == "2x2x1"
    run = served(model="google/gemma-4-31B-it", activationCheckpointing="true")
    worker = run.one(RAY_SERVICE).inputs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2"
    assert run.one(POOL, "serving-tpu").inputs["nodeConfig"]["machineType"] == "ct6e-standard-4t"


def test_serving_is_priced_per_replica_hour_in_the_cost_estimate():
    estimate = served(serveMinReplicas="1", serveReplicas="2").outputs["costEstimate"]["serving"]
    assert estimate["host"] == "v6e 1x1 (ct6e-standard-1t)" and estimate["usd_per_chip_hour"] == 2.70
    assert (estimate["usd_per_hour_per_replica"], estimate["usd_per_hour_idle"], estimate["usd_per_hour_at_most"]) == (
        2.70, 2.70, 5.40)  # fmt: skip
    assert "1 host(s) always" in estimate["bills"]
    spot = served(serveCapacity="spot", serveTopology="2x4").outputs["costEstimate"]["serving"]
    assert spot["usd_per_hour_per_replica"] == round(8 * 1.40, 2) and spot["usd_per_hour_idle"] == 0
    assert "nothing between requests" in spot["bills"]
    ironwood = served("tpu7x").outputs["costEstimate"]["serving"]
    assert ironwood["usd_per_hour_per_replica"] is None and "pricePerChipHour" in ironwood["note"]


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"serve": "yes"}, "gemma-tpu:serve: 'yes' is not a choice; allowed: off, finetuned, base"),
        ({"serveTopology": "4x4"}, "gemma-tpu:serveTopology: '4x4' is not a single-host v6e shape; allowed: 1x1, 2x2, 2x4"),
        ({"model": "google/gemma-4-31B-it", "serveTopology": "1x1"},
         "gemma-tpu:serveTopology: serving google/gemma-4-31B-it at 4,096 tokens needs about"),
        ({"serveMaxModelLen": "131073"},
         "gemma-tpu:serveMaxModelLen: 131073 is longer than google/gemma-4-E2B-it's context of 131,072 tokens"),
        ({"model": "google/gemma-4-31B-it", "serveMaxModelLen": "131072"},
         "gemma-tpu:serveMaxModelLen: serving google/gemma-4-31B-it at 131,072 tokens needs about"),
        ({"serveMinReplicas": "2"}, "gemma-tpu:serveMinReplicas: 2 must be from 0"),
        ({"serveCapacity": "flexStart"}, "gemma-tpu:serveCapacity: 'flexStart' is not a serving capacity"),
        ({"rayClusterName": "a-ray-cluster-name-of-forty-four-characters-x"},
         "gemma-tpu:rayClusterName: 'a-ray-cluster-name-of-forty-four-characters-x' makes the serving RayService"),
    ],
)  # fmt: skip
def test_a_bad_serving_value_is_refused_by_name_before_any_resource(keys, named):
    with pytest.raises(ConfigError) as err:
        served(**keys)
    assert named in str(err.value)
    assert {r.type for r in run_program.last_registered} <= {"pulumi:pulumi:Stack"}
    if "needs about" in named:  # with the plan's parts and the way out
        assert "weights" in str(err.value) and "kv_cache" in str(err.value)
        assert "serveTopology: 2x2 fits" in str(err.value) or "shorter serveMaxModelLen" in str(err.value)


def test_an_export_to_serve_must_exist_with_its_weights_and_tokenizer(tmp_path, tiny_assets):
    """serveModel, checked at preview: a directory that is not there (yet), one without weights or tokenizer, and
    one given with serve base are refused by name; a whole export is served as it is, without waiting for a run."""
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    refused = {
        str(tmp_path / "run" / "model"): f"gemma-tpu:serveModel: '{tmp_path}/run/model' does not exist (yet)",
        str(tmp_path / "config-only"): f"gemma-tpu:serveModel: '{tmp_path}/config-only' has no weights (*.safetensors)"
        " and no tokenizer (tokenizer.json or tokenizer_config.json); vLLM cannot serve it",
    }
    for model, named in refused.items():
        with pytest.raises(ConfigError, match=re.escape(named)):
            run_program("v6e", stack_config("v6e", serve="finetuned", serveModel=model))
    with pytest.raises(ConfigError, match="gemma-tpu:serveModel: names an export to serve with serve finetuned"):
        run_program("v6e", stack_config("v6e", serve="base", serveModel=tiny_assets["model"]))
    run = run_program("v6e", stack_config("v6e", serve="finetuned", serveModel=tiny_assets["model"]))
    config = yaml.safe_load(run.one(RAY_SERVICE).inputs["spec"]["serveConfigV2"])
    assert config["applications"][0]["args"]["llm_configs"][0]["model_loading_config"]["model_source"] == str(
        Path(tiny_assets["model"]).resolve())  # fmt: skip
    assert not any(urn.endswith("::training") for urn in run.one(RAY_SERVICE).dependencies)


def test_an_export_in_a_bucket_is_looked_for_at_preview(storage, metadata_server):
    """gs://: the same checks through the storage client the jobs use (here the GCS emulator)."""
    from infra.job_modules import storage as clients

    clients.gcs().pipe("gs://demo-data/runs/a/model/config.json", b"{}")
    with pytest.raises(ConfigError, match=r"'gs://demo-data/runs/b/model' does not exist \(yet\)"):
        run_program("v6e", stack_config("v6e", serveModel="gs://demo-data/runs/b/model", serve="finetuned"))
    with pytest.raises(ConfigError, match=r"'gs://demo-data/runs/a/model' has no weights"):
        run_program("v6e", stack_config("v6e", serveModel="gs://demo-data/runs/a/model", serve="finetuned"))


@pytest.mark.parametrize("least", ["0", "1"])
def test_with_a_minimum_of_zero_nothing_holds_a_tpu_host_once_the_endpoint_is_idle(least):
    """The scale-down, link by link: Serve scales the replicas to serveMinReplicas, Ray's in-tree autoscaler then
    removes the idle TPU pod (the group may go to that minimum), and GKE's autoscaler the node (the pool may go to 0).
    With a minimum of 1, one replica, pod and node stay."""
    run = served(serveMinReplicas=least, serveReplicas="2")
    spec = run.one(RAY_SERVICE).inputs["spec"]
    llm = yaml.safe_load(spec["serveConfigV2"])["applications"][0]["args"]["llm_configs"][0]
    assert llm["deployment_config"]["autoscaling_config"] == {"min_replicas": int(least), "max_replicas": 2,
                                                              "downscale_delay_s": 600}  # fmt: skip
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    (group,) = cluster["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (int(least), int(least), 2)
    pool = run.one(POOL, "serving-tpu").inputs
    assert (pool["autoscaling"]["minNodeCount"], pool["autoscaling"]["maxNodeCount"]) == (0, 2)
    assert "nodeCount" not in pool  # (the autoscaler's to set; Pulumi ignores it after creation)


def test_up_scores_the_run_through_the_endpoint_from_the_training_head():
    """The served evaluation: a job on the training cluster (its dashboard through the API server's proxy), after
    the RayService, scoring the run's tasks through the in-cluster URL within serveReadyTimeoutMinutes; not with
    serveModel (another run's tasks) or evalTasks none (no scores to compare)."""
    run = served(serveReadyTimeoutMinutes="30")
    evaluation = run.one(DYNAMIC, "served-evaluation")
    settings, export = evaluation.inputs["settings"], export_of(run)
    assert settings == {
        "run": export.rsplit("/", 1)[0], "endpoint": run.outputs["endpoint"]["url"],
        "served_model": "gemma-4-E2B-it-finetuned", "base": False, "wait_s": 1800, "tolerance": 0.02,
        "serve_dashboard": "http://ray-torchtpu-cluster-llm-head-svc.default.svc.cluster.local:8265",
    }  # fmt: skip
    assert evaluation.inputs["target"] == run.one(DYNAMIC, "training").inputs["target"]  # the training head
    assert any(urn.endswith("::serving") for urn in evaluation.dependencies)
    assert served(serve="base").one(DYNAMIC, "served-evaluation").inputs["settings"]["base"] is True
    assert not served(evalTasks="none").of_type(DYNAMIC, "served-evaluation")
    # A wait that fails scales the RayService down only where Serve would keep a replica (serveMinReplicas > 0):
    # the evaluation holds the serveConfigV2 the RayService declares, to set to a minimum of 0 and to put back.
    assert evaluation.inputs.get("ray_service") is None
    kept = served(serveMinReplicas="1")
    ray_service = as_manifest(kept.one(RAY_SERVICE, "serving"))
    assert kept.one(DYNAMIC, "served-evaluation").inputs["ray_service"] == {
        "namespace": "default", "name": ray_service["metadata"]["name"],
        "serve_config": ray_service["spec"]["serveConfigV2"],
    }  # fmt: skip


def test_the_served_scores_and_the_serving_hosts_hours_reach_evaluation_and_cost():
    """The mocks' served evaluation (30 minutes: a cold start and the scoring) reaches the outputs: its scores beside
    the job's in `evaluation`, and in `cost` the host for those minutes, Serve's 10 before it lets the replica go and
    the autoscaler's 10 idle ones after."""
    run = served()
    assert run.outputs["evaluation"]["tasks"]["heldout_loss"]["metrics"]["loss"] == {
        "base": 2.6, "fine_tuned": 2.31, "delta": -0.29, "served_fine_tuned": 2.3102}  # fmt: skip
    serving = run.outputs["cost"]["serving"]
    assert serving["host_hours"] == round((1800 + 1200) / 3600, 4) and serving["usd"] == round(3000 / 3600 * 2.70, 2)
    kept = served(serveMinReplicas="1").outputs["cost"]["serving"]
    assert kept["host_hours"] == 0.5 and "1 host(s) bill until destroy" in kept["note"]
    assert "serving" not in run_program("v6e", stack_config("v6e")).outputs["cost"]


def test_an_export_that_cannot_be_looked_at_is_refused_naming_the_sign_in(monkeypatch):
    from infra.config import serving_checks

    def unreadable(directory):
        raise OSError("google::cloud::Status(UNAUTHENTICATED)")

    monkeypatch.setattr(serving_checks, "export_files", unreadable)
    with pytest.raises(
        ConfigError,
        match=r"'gs://b/run/model' could not be looked at from here \(google::cloud::"
        r"Status\(UNAUTHENTICATED\)\); for gs://, sign in with `gcloud auth application-default login`",
    ):
        run_program("v6e", stack_config("v6e", serve="finetuned", serveModel="gs://b/run/model"))
