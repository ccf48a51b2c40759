"""The Pulumi program under mocks: every resource and its inputs, per stack and mode."""

from __future__ import annotations

import json

import pytest

from tests.stack_harness import DIGEST, PROJECT_NUMBER, SECRET_SIG, TOKEN, run_program, stack_config

STACKS = ("v6e", "tpu7x")
MODES = ("standard", "autopilot")
COMMON = [
    "gcp:artifactregistry/repository:Repository",
    "gcp:container/cluster:Cluster",
    "gcp:projects/service:Service",
    "gcp:projects/service:Service",
    "gcp:projects/service:Service",
    "gcp:projects/service:Service",
    "gcp:storage/bucket:Bucket",
    "gcp:storage/bucketIAMMember:BucketIAMMember",
    "docker:index/image:Image",
    "kubernetes:core/v1:Secret",
    "kubernetes:ray.io/v1:RayCluster",
    "pulumi-python:dynamic:Resource",
    "pulumi-python:dynamic:Resource",
    "pulumi:providers:kubernetes",
    "gemma-tpu:infra:CheckpointBucket",
    "gemma-tpu:infra:GkeCluster",
    "gemma-tpu:infra:ImageRegistry",
    "gemma-tpu:infra:KubernetesAccess",
    "gemma-tpu:infra:ProjectApis",
    "gemma-tpu:infra:RayCluster",
]
EXTRA = {
    ("v6e", "standard"): ["gcp:container/nodePool:NodePool"],
    ("tpu7x", "standard"): ["gcp:container/nodePool:NodePool", "gcp:compute/resourcePolicy:ResourcePolicy"],
}


@pytest.fixture(scope="module", params=[(s, m) for s in STACKS for m in MODES], ids=lambda p: f"{p[0]}-{p[1]}")
def run(request):
    stack, mode = request.param
    result = run_program(stack, stack_config(stack, mode=mode))
    result.stack, result.mode = stack, mode
    return result


def test_registers_exactly_the_expected_resources(run):
    assert run.types == sorted(COMMON + EXTRA.get((run.stack, run.mode), []))


def test_apis_stay_enabled_on_destroy(run):
    services = run.of_type("gcp:projects/service:Service")
    assert {s.inputs["service"] for s in services} == {
        "compute.googleapis.com",
        "container.googleapis.com",
        "artifactregistry.googleapis.com",
        "storage.googleapis.com",
    }
    assert all(s.inputs["disableOnDestroy"] is False for s in services)


def test_cluster(run):
    cluster = run.one("gcp:container/cluster:Cluster").inputs
    assert cluster["name"] == f"ray-tpu-{run.stack}"
    assert cluster["minMasterVersion"] == "1.36"
    assert cluster["deletionProtection"] is False
    assert cluster["addonsConfig"] == {
        "rayOperatorConfigs": [
            {
                "enabled": True,
                "rayClusterLoggingConfig": {"enabled": True},
                "rayClusterMonitoringConfig": {"enabled": True},
            }
        ]
    }
    if run.mode == "autopilot":
        assert cluster["location"] == "us-east5"
        assert cluster["enableAutopilot"] is True
        assert "nodeConfig" not in cluster
    else:
        assert cluster["location"] == "us-east5-b"
        assert "enableAutopilot" not in cluster
        assert cluster["initialNodeCount"] == 1
        assert cluster["nodeConfig"] == {
            "machineType": "n2-standard-8",
            "gcfsConfig": {"enabled": True},
            "workloadMetadataConfig": {"mode": "GKE_METADATA"},
        }
        assert cluster["datapathProvider"] == "ADVANCED_DATAPATH"
        assert cluster["workloadIdentityConfig"] == {"workloadPool": "demo-project.svc.id.goog"}


def test_tpu_node_pool(run):
    pools = run.of_type("gcp:container/nodePool:NodePool")
    if run.mode == "autopilot":
        assert pools == []
        return
    pool = pools[0].inputs
    assert pool["name"] == "tpu-multi-host-pool"
    assert pool["location"] == "us-east5-b"
    assert pool["cluster"] == f"ray-tpu-{run.stack}"
    hosts = {"v6e": 4, "tpu7x": 2}[run.stack]
    # scaleToZero (the default): created empty, autoscaled per zone up to one whole slice
    assert "nodeCount" not in pool and pool["initialNodeCount"] == 0
    assert pool["autoscaling"] == {"minNodeCount": 0, "maxNodeCount": hosts, "locationPolicy": "ANY"}
    assert pool["nodeLocations"] == ["us-east5-b"]
    if run.stack == "v6e":
        assert pool["nodeConfig"]["machineType"] == "ct6e-standard-4t"
        assert pool["placementPolicy"] == {"type": "COMPACT", "tpuTopology": "4x4"}
    else:
        policy = run.one("gcp:compute/resourcePolicy:ResourcePolicy").inputs
        assert policy["region"] == "us-east5"
        assert policy["workloadPolicy"] == {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "2x2x2"}
        assert pool["nodeConfig"]["machineType"] == "tpu7x-standard-4t"
        # no placement type beside a workload policy: GKE refuses one for tpu7x and stores none
        assert pool["placementPolicy"] == {"type": "", "policyName": policy["name"], "tpuTopology": "2x2x2"}
    assert "spot" not in pool["nodeConfig"] and "reservationAffinity" not in pool["nodeConfig"]


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale_to_zero", ["true", "false"])
def test_scale_to_zero_or_the_walkthroughs_always_on_slice(stack, mode, scale_to_zero):
    run = run_program(stack, stack_config(stack, mode=mode, scaleToZero=scale_to_zero))
    on = scale_to_zero == "true"
    hosts, group = {"v6e": (4, "v6e-16"), "tpu7x": (2, "tpu7x-16")}[stack]
    worker = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    cluster = run.one("gcp:container/cluster:Cluster").inputs
    if on:
        assert "replicas" not in worker and (worker["minReplicas"], worker["maxReplicas"]) == (0, 1)
        assert training["slice"] == {
            "ray_cluster": "ray-torchtpu-cluster", "group": group, "replicas": 1, "hosts": hosts,
            "ready_timeout_s": 1800, "capacity": "onDemand",
        }  # fmt: skip
    else:
        assert worker["replicas"] == 1 and "minReplicas" not in worker and "maxReplicas" not in worker
        assert training.get("slice") is None  # Pulumi drops a None input
    assert run.outputs["sliceHours"] == 0.1
    if mode == "autopilot":  # no pool, no autoscaler profile: the pods ask for the nodes
        assert run.of_type("gcp:container/nodePool:NodePool") == [] and "clusterAutoscaling" not in cluster
        return
    pool = run.one("gcp:container/nodePool:NodePool")
    if on:
        assert cluster["clusterAutoscaling"] == {"enabled": False, "autoscalingProfile": "OPTIMIZE_UTILIZATION"}
        assert pool.inputs["autoscaling"]["maxNodeCount"] == hosts and "nodeCount" not in pool.inputs
    else:
        assert "clusterAutoscaling" not in cluster
        assert pool.inputs["nodeCount"] == hosts and "autoscaling" not in pool.inputs
        assert "initialNodeCount" not in pool.inputs and "nodeLocations" not in pool.inputs


def test_a_reservation_keeps_its_slice_unless_told_otherwise():
    reserved = run_program("v6e", stack_config("v6e", reservation="r1"))
    assert reserved.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]["replicas"] == 1
    assert reserved.one("pulumi-python:dynamic:Resource", "training").inputs.get("slice") is None
    told = run_program("v6e", stack_config("v6e", reservation="r1", scaleToZero="true"))
    assert told.one("pulumi-python:dynamic:Resource", "training").inputs["slice"]["hosts"] == 4


def test_pulumi_config_documents_scale_to_zero():
    from infra.config.stack import declared_keys

    keys = declared_keys()
    # no declared default: the CLI would apply it, and a reservation could no longer turn it off (its default)
    assert keys["scaleToZero"]["type"] == "boolean" and "default" not in keys["scaleToZero"]
    assert keys["scaleToZero"]["description"].startswith("(default true; false with a reservation)")
    assert "reservation" in keys["scaleToZero"]["description"] and "walkthrough" in keys["scaleToZero"]["description"]
    assert (keys["sliceReadyTimeoutMinutes"]["type"], keys["sliceReadyTimeoutMinutes"]["default"]) == ("integer", 30)


def test_bucket_and_workload_identity_grant(run):
    bucket = run.one("gcp:storage/bucket:Bucket").inputs
    assert bucket["name"] == f"demo-project-{run.stack}-checkpoints"
    assert bucket["location"] == "US-EAST5"
    assert bucket["uniformBucketLevelAccess"] is True
    member = run.one("gcp:storage/bucketIAMMember:BucketIAMMember").inputs
    assert member["bucket"] == bucket["name"]
    assert member["role"] == "roles/storage.objectAdmin"
    assert member["member"] == (
        f"principal://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/"
        "workloadIdentityPools/demo-project.svc.id.goog/subject/ns/default/sa/default"
    )


def test_repository_and_image(run):
    repo = run.one("gcp:artifactregistry/repository:Repository").inputs
    assert repo["format"] == "DOCKER" and repo["location"] == "us-east5"
    image = run.one("docker:index/image:Image").inputs
    assert image["imageName"] == "us-east5-docker.pkg.dev/demo-project/ray-torchtpu/ray-torchtpu:latest"
    assert image["buildOnPreview"] is False
    assert image["build"]["dockerfile"].endswith("image/Dockerfile")
    assert image["registry"][SECRET_SIG]  # the registry block carries an access token
    registry = image["registry"]["value"]
    assert registry["server"] == "us-east5-docker.pkg.dev"
    assert registry["username"] == "oauth2accesstoken"


def test_secret_holds_the_token_under_the_walkthrough_names(run):
    secret = run.one("kubernetes:core/v1:Secret")
    assert secret.inputs["metadata"]["name"] == "hf-secret"
    assert secret.inputs["stringData"][SECRET_SIG]
    assert secret.inputs["stringData"]["value"] == {"hf_api_token": TOKEN}


def test_ray_cluster_waits_for_crd_and_head(run):
    rc = run.one("kubernetes:ray.io/v1:RayCluster").inputs
    assert rc["metadata"]["annotations"] == {"pulumi.com/waitFor": "condition=HeadPodReady"}
    image = f"us-east5-docker.pkg.dev/demo-project/ray-torchtpu/ray-torchtpu@{DIGEST}"
    containers = [rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]] + [
        g["template"]["spec"]["containers"][0] for g in rc["spec"]["workerGroupSpecs"]
    ]
    assert {c["image"] for c in containers} == {image}
    crd = run.one("pulumi-python:dynamic:Resource", "ray-torchtpu-cluster-crd").inputs
    assert crd["crd"] == "rayclusters.ray.io" and crd["endpoint"] == "203.0.113.10"


def test_outputs(run):
    assert run.outputs["clusterName"] == f"ray-tpu-{run.stack}"
    assert run.outputs["bucket"] == f"gs://demo-project-{run.stack}-checkpoints"
    assert run.outputs["image"].endswith("@" + DIGEST)
    assert run.outputs["rayClusterName"] == "ray-torchtpu-cluster"
    assert "svc/ray-torchtpu-cluster-head-svc 8265:8265" in run.outputs["dashboard"]
    kubeconfig = json.loads(run.outputs["kubeconfig"])
    assert kubeconfig["users"][0]["user"]["exec"]["command"] == "gke-gcloud-auth-plugin"
    assert "auth-provider" not in run.outputs["kubeconfig"]
    assert kubeconfig["clusters"][0]["cluster"]["server"] == "https://203.0.113.10"
    assert run.secret_outputs == {"kubeconfig"}
    assert run.outputs["checkpoint"].startswith(f"gs://demo-project-{run.stack}-checkpoints/ray_train_torchtpu/")
    assert run.outputs["metrics"] == {"epoch": 3, "loss": 2.2}
    assert run.outputs["lossCurve"] == f"gs://demo-project-{run.stack}-checkpoints/ray_train_torchtpu/sft-run/loss.png"
    assert run.outputs["jobIds"] == {"collectives": "c-a1", "finetune": "f-a1"}


def test_training_jobs_resource(run):
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    assert training["stack"] == run.stack
    assert training["cluster"] == f"ray-tpu-{run.stack}"
    assert training["image"].endswith("@" + DIGEST)
    assert len(training["code"]) == 64
    topology, accelerator = {"v6e": ("4x4", "TPU-V6E"), "tpu7x": ("2x2x2", "TPU-V7X")}[run.stack]
    assert training["settings"] == {  # the fine-tune's settings (jobs/config/settings.py) but maxFailures and the unset
        "recipe": "default", "model": "google/gemma-4-E2B-it", "dataset": "databricks/databricks-dolly-15k",
        "split": "train[:1024]", "eval_split": "auto", "eval_tasks": "heldout", "eval_limit": 64, "objective": "sft", "dpo_beta": 0.1, "dpo_loss": "sigmoid", "num_generations": 8.0, "max_completion_length": 512.0, "temperature": 1.0, "beta": 0.0, "epsilon": 0.2, "loss_type": "dapo", "scale_rewards": "group", "rewards": "answer_match", "overlong": "truncate",
        "epochs": 3, "batch_size": 4, "grad_accum": 1, "seq_len": 512,
        "packing": True, "chat_template": True, "prompt_loss": False,
        "lr": 2e-05, "lr_schedule": "cosine", "warmup_ratio": 0.03, "max_grad_norm": 1.0, "weight_decay": 0.01,
        "attention": "eager", "loss_chunk": 256, "max_steps": 0, "save_every": 500, "eval_every": 500,
        "eval_samples": 4, "activation_checkpointing": False, "compile": False, "lora": False, "lora_rank": 16, "lora_alpha": 32, "modality": "auto", "train_towers": False, "seed": 42,
        "topology": topology, "accelerator_type": accelerator, "backend": "tpu", "num_slices": 1,
        "storage_path": f"gs://demo-project-{run.stack}-checkpoints/ray_train_torchtpu",
        "sharded_checkpoints": True, "async_checkpoint": True, "preflight": False, "prepare_chunk": 2048,
    }  # fmt: skip
    assert training["target"] == {
        "kind": "gke",
        "endpoint": "203.0.113.10",
        "ca_certificate": "Q0EtQ0VSVA==",
        "namespace": "default",
        "service": "ray-torchtpu-cluster-head-svc",
        "port": 8265,
    }
    assert training["timeout_s"] == 240 * 60


def _plain_occurrences(node, needle: str) -> int:
    """How often `needle` appears outside Pulumi secret envelopes."""
    if isinstance(node, dict):
        if SECRET_SIG in node:
            return 0
        return sum(_plain_occurrences(v, needle) for v in node.values())
    if isinstance(node, list):
        return sum(_plain_occurrences(v, needle) for v in node)
    return int(isinstance(node, str) and needle in node)


def test_token_never_in_plain_text(run):
    assert sum(_plain_occurrences(r.raw, TOKEN) for r in run.resources) == 0
    assert all(TOKEN not in json.dumps(v) for k, v in run.outputs.items())
    # the check itself bites: the Secret does carry the token, wrapped
    assert json.dumps(run.one("kubernetes:core/v1:Secret").raw).count(TOKEN) == 1


@pytest.mark.parametrize("mode", MODES)
def test_spot(mode):
    run = run_program("v6e", stack_config("v6e", mode=mode, spot="true"))
    if mode == "standard":
        assert run.one("gcp:container/nodePool:NodePool").inputs["nodeConfig"]["spot"] is True
    else:
        worker = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]
        assert worker["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"


@pytest.mark.parametrize("mode", MODES)
def test_specific_reservation(mode):
    run = run_program("tpu7x", stack_config("tpu7x", mode=mode, reservation="projects/shared-proj/reservations/iw-res"))
    if mode == "standard":
        affinity = run.one("gcp:container/nodePool:NodePool").inputs["nodeConfig"]["reservationAffinity"]
        assert affinity == {
            "consumeReservationType": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": ["projects/shared-proj/reservations/iw-res"],
        }
    else:
        worker = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]
        selector = worker["template"]["spec"]["nodeSelector"]
        assert selector["cloud.google.com/reservation-name"] == "iw-res"
        assert selector["cloud.google.com/reservation-affinity"] == "specific"
        assert selector["cloud.google.com/reservation-project"] == "shared-proj"


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("recipe", ["default", "walkthrough"])
def test_the_recipe_reaches_the_fine_tune_as_its_flags(stack, recipe):
    """`recipe: walkthrough` is the walkthrough's every default; the fine-tune, parsing the flags the
    job resource passes it, ends with exactly the stack's settings; maxFailures is passed on."""
    from config.command_line import from_args
    from config.command_line import parse_args as ft_parse_args
    from config.settings import RECIPE_SETTINGS, recipe_values
    from infra.runner.ray_jobs import job_specs
    from ray_core_collectives import parse_args as collectives_parse_args

    walkthrough = recipe == "walkthrough"
    flags = {"recipe": recipe, "maxFailures": "0"} if walkthrough else {}
    run = run_program(stack, stack_config(stack, **flags))
    training = run.one("pulumi-python:dynamic:Resource", "training").inputs
    settings = training["settings"]
    assert {k: settings[k] for k in RECIPE_SETTINGS} == recipe_values(recipe)
    assert (settings["packing"], settings["sharded_checkpoints"], settings["eval_split"]) == (
        (False, False, "none") if walkthrough else (True, True, "auto")
    )
    assert training["max_failures"] == (0 if walkthrough else 3)
    # as the jobs' own parsers read them, after Pulumi's wire format made every number a float
    wire = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in settings.items()}
    collectives, finetune = job_specs(wire, float(training["max_failures"]))
    parsed = from_args(ft_parse_args(list(finetune.args)))
    assert (parsed.epochs, parsed.batch_size, parsed.seq_len, parsed.grad_accum) == (3, 4, 512, 1)
    assert {k: getattr(parsed, k) for k in RECIPE_SETTINGS} == {k: settings[k] for k in RECIPE_SETTINGS}
    assert parsed.recipe == recipe and parsed.max_failures == training["max_failures"]
    assert collectives_parse_args(list(collectives.args)).topology == settings["topology"]
    args = " ".join(finetune.args)
    if walkthrough:
        assert "--no-packing --no-chat-template --prompt-loss" in args and "--max-failures=0" in args
    else:
        assert "--packing --chat-template --no-prompt-loss" in args and "--max-failures=3" in args


def test_a_single_key_overrides_its_recipe():
    run = run_program("v6e", stack_config("v6e", recipe="walkthrough", packing="true", evalSplit="train[1024:1088]"))
    settings = run.one("pulumi-python:dynamic:Resource", "training").inputs["settings"]
    assert (settings["packing"], settings["eval_split"], settings["chat_template"]) == (True, "train[1024:1088]", False)


@pytest.mark.parametrize("mode", MODES)
def test_a_dataset_file_is_uploaded_under_its_content_hash_and_read_by_the_job(mode, tmp_path):
    import hashlib

    from config.command_line import parse_args
    from infra.runner.ray_jobs import base_id, job_specs

    data = tmp_path / "my-data.jsonl"
    data.write_text('{"prompt": "Describe bees.", "completion": "Bees are warm."}\n' * 8)

    def up(columns: str = "prompt=question") -> tuple[object, dict]:
        run = run_program("v6e", stack_config("v6e", mode=mode, datasetFile=str(data), datasetColumns=columns))
        return run, run.one("pulumi-python:dynamic:Resource", "training").inputs

    run, training = up()
    digest = hashlib.sha256(data.read_bytes()).hexdigest()[:16]
    upload = run.one("gcp:storage/bucketObject:BucketObject").inputs
    assert upload["bucket"] == "demo-project-v6e-checkpoints" and upload["name"] == f"datasets/my-data-{digest}.jsonl"
    assert upload["source"].path == str(data)
    uri = f"gs://demo-project-v6e-checkpoints/datasets/my-data-{digest}.jsonl"
    assert training["settings"]["dataset"] == uri
    args = parse_args(list(job_specs(training["settings"], training["max_failures"])[1].args))
    assert (args.dataset, args.columns) == (uri, "prompt=question")
    assert "gemma-tpu:infra:DatasetFile" in run.types
    assert up()[1]["settings"] == training["settings"]  # unchanged file: the same run, nothing re-runs
    data.write_text(data.read_text() + '{"prompt": "And tides?", "completion": "Tides are late."}\n')
    edited = up()[1]
    assert edited["settings"]["dataset"] != uri and base_id(edited, "finetune") != base_id(training, "finetune")


def test_the_local_stack_reads_a_dataset_file_in_place(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    overrides = {"gcp:project": None, "gcp:region": None, "gcp:zone": None, "hfToken": None, "dataset": None}
    run = run_program("local", stack_config("local", datasetFile=str(data), **overrides))
    assert run.of_type("gcp:storage/bucketObject:BucketObject") == []
    assert run.one("pulumi-python:dynamic:Resource", "training").inputs["settings"]["dataset"] == str(data)


def test_the_memory_plan_is_a_preview_output_and_the_walkthroughs_settings_fit():
    for stack in STACKS:
        plan = run_program(stack, stack_config(stack)).outputs["memoryPlan"]
        assert plan["model"] == "google/gemma-4-E2B-it" and plan["fits"] is True and plan["estimate"] is True
        assert plan["devices"] == 16 and plan["hbm_gib"] == {"v6e": 32, "tpu7x": 96}[stack]
        assert set(plan) >= {"weights", "gradients", "optimizer", "frozen_tables", "gathered", "activations",
                             "logits", "total_gib", "usable_gib", "headroom_gib"}  # fmt: skip
        assert plan["headroom_gib"] == pytest.approx(plan["usable_gib"] - plan["total_gib"], abs=0.02)
    other = run_program("v6e", stack_config("v6e", model="my-org/my-gemma")).outputs["memoryPlan"]
    assert other["plan"].startswith("none at preview")


def test_31b_at_four_rows_of_4096_tokens_is_told_a_full_fine_tune_that_fits_and_that_one_is_accepted():
    """Neither checkpointing nor one row a device fits on the 4x4; with a 4x8 as well it does. The advice,
    set as the stack keys it names, previews with a plan that fits."""
    from infra.config.stack import ConfigError

    with pytest.raises(ConfigError) as err:
        run_program("v6e", stack_config("v6e", model="google/gemma-4-31B-it", seqLen="4096"))
    advice = "activationCheckpointing: true, batchSize: 1, gradAccum: 4, tpuTopology: 4x8"
    assert str(err.value).endswith(f"It would fit with {advice} (24.8 GiB; the global batch unchanged).")
    keys = dict(item.split(": ") for item in advice.split(", "))
    accepted = run_program("v6e", stack_config("v6e", model="google/gemma-4-31B-it", seqLen="4096", **keys))
    plan = accepted.outputs["memoryPlan"]
    assert plan["fits"] and plan["total_gib"] == pytest.approx(24.8, abs=0.05) and plan["devices"] == 32


def test_objective_dpo_previews_with_two_rows_a_pair_in_its_memory_plan_and_price():
    """objective: dpo on the v6e stack: the plan holds two sequences a record (chosen and rejected), the price two
    padded rows a pair and the reference pass, and the job is sent --objective dpo with its beta and loss; with
    the walkthrough's Dolly as its data it is refused at preview."""
    from config.command_line import from_args, parse_args
    from infra.config.stack import ConfigError
    from infra.prices import training_minutes
    from tests.stack_harness import parse_as_cli

    pairs = {"objective": "dpo", "dataset": "trl-lib/ultrafeedback_binarized"}
    sft, dpo = (run_program("v6e", stack_config("v6e", **extra)).outputs for extra in ({}, pairs))
    assert dpo["memoryPlan"]["fits"] and dpo["memoryPlan"]["activations"] == pytest.approx(
        2 * sft["memoryPlan"]["activations"], abs=0.02)  # (both rounded to 0.01 GiB)  # fmt: skip
    assert dpo["costEstimate"]["training_minutes"][1] > sft["costEstimate"]["training_minutes"][1]
    # 1024 pairs x 2 padded rows x 3 epochs (+1/48 held out) and a forward pass over them, at 20,300 tokens/s
    minutes = training_minutes(parse_as_cli(pairs))
    assert minutes == pytest.approx(((1024 * 2 * 3 * 512 * (1 + 1 / 48) + 1024 * 2 * 512 / 3) / 20_300 / 60,) * 2)
    from infra.runner.ray_jobs import job_specs

    settings = run_program("v6e", stack_config("v6e", **pairs, dpoBeta="0.2")).one(
        "pulumi-python:dynamic:Resource", "training").inputs["settings"]  # fmt: skip
    job = from_args(parse_args(list(job_specs(settings, 3)[1].args)))  # the job's command line, as the stack sends it
    assert (job.objective, job.dpo_beta, job.dpo_loss, job.packing) == ("dpo", 0.2, "sigmoid", False)
    with pytest.raises(ConfigError, match="holds instructions, not preference pairs: gemma-tpu:objective dpo"):
        run_program("v6e", stack_config("v6e", objective="dpo"))


def test_31b_on_v6e_is_refused_with_its_advice_then_accepted_with_activation_checkpointing():
    from infra.config.stack import ConfigError

    with pytest.raises(ConfigError) as err:
        run_program("v6e", stack_config("v6e", model="google/gemma-4-31B-it"))
    message = str(err.value)
    assert "gemma-tpu:model: google/gemma-4-31B-it needs about 74.9 GiB per device on v6e 4x4" in message
    assert "(32 GiB a device, 28.8 usable with the plan's margin)" in message and "activations 50.6" in message
    assert message.endswith("It would fit with activationCheckpointing: true (26.3 GiB).")
    accepted = run_program("v6e", stack_config("v6e", model="google/gemma-4-31B-it", activationCheckpointing="true"))
    assert accepted.outputs["memoryPlan"]["fits"] and accepted.outputs["memoryPlan"]["total_gib"] == 26.35
    both = run_program("v6e", stack_config("v6e", model="google/gemma-4-31B-it", activationCheckpointing="true",
                                           lora="true"))  # fmt: skip
    settings = both.one("pulumi-python:dynamic:Resource", "training").inputs["settings"]
    assert (settings["lora"], settings["activation_checkpointing"], settings["lora_rank"]) == (True, True, 16)
    from config.command_line import from_args, parse_args
    from infra.runner.ray_jobs import job_specs

    args = from_args(parse_args(list(job_specs(settings, 3)[1].args)))
    assert (args.lora, args.activation_checkpointing, args.lora_rank, args.lora_alpha) == (
        True,
        True,
        16,
        32,
    )
    assert run_program("tpu7x", stack_config("tpu7x", model="google/gemma-4-31B-it")).outputs["memoryPlan"]["fits"]


def test_a_misspelt_key_is_refused_at_preview_naming_the_key_it_meant():
    """`pulumi config set lerningRate 1e-3` reaches the program as gemma-tpu:lerningRate beside the declared
    learningRate's default: refused before any resource, naming learningRate, on both stacks."""
    from infra.config.stack import ConfigError

    for stack in ("v6e", "tpu7x"):
        with pytest.raises(ConfigError) as err:
            run_program(stack, stack_config(stack, lerningRate="1e-3"))
        assert "gemma-tpu:lerningRate: not a key this project reads; did you mean learningRate?" in str(err.value)
        assert {r.type for r in run_program.last_registered} <= {"pulumi:pulumi:Stack"}


def test_every_key_the_cli_hands_over_is_read_from_pulumi_config_too(monkeypatch):
    """Under the CLI the language host hands the program its config as PULUMI_CONFIG (JSON; the SDK's
    runtime/config.py reads it when nothing was set), not through set_all_config: a misspelt key is seen there."""
    import json

    from pulumi.runtime import config

    from infra.config.stack import project_keys

    monkeypatch.setenv("PULUMI_CONFIG", json.dumps({"gemma-tpu:lerningRate": "1e-3", "gcp:project": "demo"}))
    token = config.CONFIG.set({})
    try:
        assert project_keys() == {"lerningRate"}
    finally:
        config.CONFIG.reset(token)


def test_an_image_and_audio_run_previews_with_its_towers_and_a_size_without_them_is_refused():
    """modality image+audio on v6e: the plan holds the towers (E2B's ~150M + ~300M, bf16, on every device), the
    price the towers' compute at its high end, and the job is sent --modality; 31B (no audio tower) is refused at
    preview naming the sizes that have one; image alone on 31B previews with its ~550M vision tower."""
    from infra.config.stack import ConfigError

    text, media = (run_program("v6e", stack_config("v6e", **extra)).outputs
                   for extra in ({}, {"modality": "image+audio"}))  # fmt: skip
    assert "towers" not in text["memoryPlan"] or isinstance(text["memoryPlan"]["towers"], str)
    assert media["memoryPlan"]["towers"] == pytest.approx(450e6 * 2 / 2**30, abs=0.01) and media["memoryPlan"]["fits"]
    assert media["memoryPlan"]["total_gib"] == pytest.approx(
        text["memoryPlan"]["total_gib"] + media["memoryPlan"]["towers"], abs=0.02)  # fmt: skip
    low, high = media["costEstimate"]["training_minutes"]
    assert low == text["costEstimate"]["training_minutes"][0] and high > text["costEstimate"]["training_minutes"][1]
    assert "the image and audio towers' compute" in media["costEstimate"]["assumptions"]
    training = run_program("v6e", stack_config("v6e", modality="image+audio")).one(
        "pulumi-python:dynamic:Resource", "training")  # fmt: skip
    assert training.inputs["settings"]["modality"] == "image+audio"
    with pytest.raises(
        ConfigError,
        match=r"gemma-tpu:modality: image\+audio needs Gemma 4's audio tower, which "
        r"google/gemma-4-31B-it \(31B\) does not have: use a size that has it \(E2B, E4B: google/gemma-4-E2B-it\)",
    ):
        run_program("v6e", stack_config("v6e", model="google/gemma-4-31B-it", modality="image+audio",
                                        activationCheckpointing="true"))  # fmt: skip
    vision = run_program("v6e", stack_config("v6e", model="google/gemma-4-31B-it", modality="image",
                                             activationCheckpointing="true")).outputs["memoryPlan"]  # fmt: skip
    assert vision["towers"] == pytest.approx(550e6 * 2 / 2**30, abs=0.01)


def test_gemma_4_12b_previews_with_its_memory_plan_and_price():
    """google/gemma-4-12B-it, the size published after the table was first written: its row plans it on both
    stacks and prices it on v6e (training minutes and dollars), and its context is 256K."""
    for stack in STACKS:
        out = run_program(
            stack, stack_config(stack, model="google/gemma-4-12B-it", activationCheckpointing="true")
        ).outputs
        assert out["memoryPlan"]["model"] == "google/gemma-4-12B-it" and out["memoryPlan"]["fits"]
        # (tpu7x has no public price: its estimate asks for pricePerChipHour, as for every size)
        assert out["costEstimate"].get("usd", [1])[0] > 0 and out["costEstimate"]["usd_per_hour"] != 0
    assert out["memoryPlan"]["gathered"] > 0 and out["costEstimate"]["note"].startswith("no public price")
    from infra.cloud.models import CONTEXT_TOKENS, known_model

    assert known_model("google/gemma-4-12b-it").name == "12B" and CONTEXT_TOKENS["12B"] == 262_144


def test_a_grpo_stack_plans_the_sampler_and_the_reference_and_refuses_what_the_cluster_cannot_read():
    """objective grpo at preview: the memory plan's sampler KV cache and, with beta, the reference copy; the minutes
    count the sampled completions; the job gets TRL's knobs; a reward file on this machine is refused (the job runs
    on the cluster), one on gs:// accepted; a numGenerations that splits a rank's batch refused by its key."""
    from config.command_line import from_args, parse_args
    from infra.config.stack import ConfigError
    from infra.prices import training_minutes
    from infra.runner.ray_jobs import job_specs
    from tests.stack_harness import parse_as_cli

    prompts = {"objective": "grpo", "dataset": "openai/gsm8k", "datasetConfig": "main",
               "datasetColumns": "prompt=question", "rewards": "gsm8k", "numGenerations": "4"}  # fmt: skip
    plain, with_beta = (run_program("v6e", stack_config("v6e", **prompts, **extra)).outputs["memoryPlan"]
                        for extra in ({}, {"beta": "0.04"}))  # fmt: skip
    assert plain["kv_cache"] > 0 and "reference" not in plain and with_beta["reference"] > plain["weights"]
    low, high = training_minutes(parse_as_cli(prompts | {"maxSteps": "10"}))
    assert 0 < low < high
    run = run_program(
        "v6e", stack_config("v6e", **prompts | {"beta": "0.04", "rewards": "gs://b/rewards/mine.py:score"})
    )
    settings = run.one("pulumi-python:dynamic:Resource", "training").inputs["settings"]
    job = from_args(parse_args(list(job_specs(settings, 3)[1].args)))
    assert (job.objective, job.num_generations, job.beta, job.loss_type, job.rewards) == (
        "grpo", 4, 0.04, "dapo", "gs://b/rewards/mine.py:score")  # fmt: skip
    with pytest.raises(ConfigError, match=r"gemma-tpu:rewards: 'mine.py:score' is a file on this machine, which the "
                       r"cluster's job cannot read: copy it to the bucket"):  # fmt: skip
        run_program("v6e", stack_config("v6e", **prompts | {"rewards": "mine.py:score"}))
    with pytest.raises(
        ConfigError, match="gemma-tpu:batchSize: 4 does not hold whole groups of gemma-tpu:numGenerations 3"
    ):
        run_program("v6e", stack_config("v6e", **prompts | {"numGenerations": "3"}))


def test_a_grpo_data_file_without_a_prompt_column_is_refused_at_preview_naming_its_columns(tmp_path):
    """objective grpo on a datasetFile: its first record's (a CSV's header's) columns must hold a prompt, after
    datasetColumns' renames, or the preview names the file's columns and the rename, as the job would before Ray."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from infra.config.stack import ConfigError

    grpo = {"objective": "grpo", "rewards": "answer_match", "numGenerations": "4"}
    records = tmp_path / "math.jsonl"
    records.write_text('\n{"question": "two and two", "answer": "4"}\n')
    (table := tmp_path / "math.csv").write_text("question,answer\ntwo and two,4\n")
    pq.write_table(pa.table({"prompt": ["two and two"], "answer": ["4"]}), parquet := tmp_path / "math.parquet")
    for bad in (records, table):
        with pytest.raises(ConfigError, match=rf"gemma-tpu:datasetFile: {bad.name} has no prompt column for "
                           r"gemma-tpu:objective grpo \(its columns: question, answer\): rename the one that holds "
                           r"the prompts, e.g. pulumi config set gemma-tpu:datasetColumns prompt=question"):  # fmt: skip
            run_program("v6e", stack_config("v6e", **grpo, datasetFile=str(bad)))
    for good in ({"datasetFile": str(records), "datasetColumns": "prompt=question"}, {"datasetFile": str(parquet)}):
        assert run_program("v6e", stack_config("v6e", **grpo, **good)).outputs["memoryPlan"]["kv_cache"] > 0
