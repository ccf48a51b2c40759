"""Config: derived values per topology, and every bad input rejected before any resource."""

from __future__ import annotations

import pytest

from infra.cloud.tpu import GENERATIONS, TpuSlice
from infra.config import stack as config
from infra.config.reader import Reader
from infra.config.stack import ConfigError
from tests.stack_harness import as_cli, parse_as_cli, run_program, stack_config

EXPECTED_SLICES = {
    ("v6e", "4x4"): (16, 4, 16, "v6e-16"),
    ("v6e", "4x8"): (32, 8, 32, "v6e-32"),
    ("v6e", "8x8"): (64, 16, 64, "v6e-64"),
    ("v6e", "8x16"): (128, 32, 128, "v6e-128"),
    ("v6e", "16x16"): (256, 64, 256, "v6e-256"),
    ("tpu7x", "2x2x2"): (8, 2, 16, "tpu7x-16"),
    ("tpu7x", "2x2x4"): (16, 4, 32, "tpu7x-32"),
    ("tpu7x", "2x4x4"): (32, 8, 64, "tpu7x-64"),
    ("tpu7x", "4x4x4"): (64, 16, 128, "tpu7x-128"),
    ("tpu7x", "4x4x8"): (128, 32, 256, "tpu7x-256"),
    ("tpu7x", "4x8x8"): (256, 64, 512, "tpu7x-512"),
    ("tpu7x", "8x8x8"): (512, 128, 1024, "tpu7x-1024"),
}


def test_every_allowed_topology_is_covered():
    assert {(g.name, t) for g in GENERATIONS.values() for t in g.topologies} == set(EXPECTED_SLICES)


@pytest.mark.parametrize("generation,topology", EXPECTED_SLICES)
def test_derived_values(generation, topology):
    tpu = TpuSlice(GENERATIONS[generation], topology)
    chips, hosts, devices, group = EXPECTED_SLICES[generation, topology]
    assert (tpu.chips, tpu.hosts, tpu.devices, tpu.worker_group) == (chips, hosts, devices, group)
    assert tpu.node_selector == {
        "cloud.google.com/gke-tpu-accelerator": {"v6e": "tpu-v6e-slice", "tpu7x": "tpu7x"}[generation],
        "cloud.google.com/gke-tpu-topology": topology,
    }
    if generation == "tpu7x":
        assert tpu.devices_per_host == 8 and tpu.ray_start_params == {"resources": "'{\"TPU\":8}'"}
        assert tpu.ray_env == [{"name": "RAY_TPU_RESOURCE_PER_CHIP", "value": "2"}]
        assert tpu.generation.ray_accelerator_type == "TPU-V7X"
    else:
        assert tpu.devices_per_host == 4 and tpu.ray_start_params == {} and tpu.ray_env == []
        assert tpu.generation.ray_accelerator_type == "TPU-V6E"


def test_the_jobs_and_the_stack_read_one_tpu_table():
    """The TPU facts live in jobs/runtime/tpu_generations.py; the stack's slice is derived from that same table, and the
    fine-tune's worker count from it agrees with the slice's devices."""
    from config.setting_checks import worker_count
    from config.settings import FinetuneSettings
    from infra.cloud import tpu
    from infra.job_modules import tpu_generations

    assert tpu.GENERATIONS is tpu_generations.GENERATIONS
    for generation in GENERATIONS.values():
        for topology in generation.topologies:
            tpu_slice = TpuSlice(generation, topology)
            job = FinetuneSettings(topology=topology, accelerator_type=generation.ray_accelerator_type)
            assert worker_count(job) == tpu_slice.devices
            assert tpu_generations.by_accelerator_type(generation.ray_accelerator_type) is generation


def test_defaults_come_from_pulumi_yaml():
    cfg = parse_as_cli({})
    assert cfg.region == "us-east5"  # derived from the zone
    assert (cfg.mode, cfg.slice.worker_group, cfg.cluster_version) == ("standard", "v6e-16", "1.36")
    assert (cfg.job.model, cfg.job.epochs, cfg.job.batch_size) == ("google/gemma-4-E2B-it", 3, 4)
    assert cfg.bucket_name == "p-v6e-checkpoints" and cfg.deletion_protection is False


BAD = {
    "unknown generation": (
        "v6e",
        {"tpuGeneration": "v9"},
        "gemma-tpu:tpuGeneration: 'v9' is not a known TPU generation; allowed: v6e, tpu7x",
    ),
    "3x3 on v6e": (
        "v6e",
        {"tpuTopology": "3x3"},
        "gemma-tpu:tpuTopology: '3x3' is not a v6e multi-host topology; allowed for v6e: 4x4",
    ),
    "4x4 on tpu7x": (
        "tpu7x",
        {"tpuTopology": "4x4"},
        "gemma-tpu:tpuTopology: '4x4' is not a tpu7x multi-host topology; allowed for tpu7x: 2x2x2",
    ),
    "4x4x": ("v6e", {"tpuTopology": "4x4x"}, "gemma-tpu:tpuTopology: '4x4x' is not a topology; allowed for v6e: 4x4"),
    "abc": (
        "tpu7x",
        {"tpuTopology": "abc"},
        "gemma-tpu:tpuTopology: 'abc' is not a topology; allowed for tpu7x: 2x2x2",
    ),
    "unknown mode": (
        "v6e",
        {"mode": "serverless"},
        "gemma-tpu:mode: 'serverless' is not a mode; allowed: standard, autopilot",
    ),
    "spot with reservation": (
        "v6e",
        {"spot": "true", "reservation": "r1"},
        "gemma-tpu:spot: true cannot be combined with gemma-tpu:reservation 'r1'",
    ),
    "spot in local mode": (
        "local",
        {"spot": "true"},
        "gemma-tpu:mode: 'local' runs no TPU; unset gemma-tpu:capacity, gemma-tpu:spot and gemma-tpu:reservation",
    ),
    "bad reservation": (
        "v6e",
        {"reservation": "Not A Name"},
        "gemma-tpu:reservation: 'Not A Name' must be NAME or projects/PROJECT/reservations/NAME",
    ),
    "spot not boolean": ("v6e", {"spot": "yes"}, "gemma-tpu:spot: 'yes' is not boolean"),
    "missing project": ("v6e", {"gcp:project": None}, "gcp:project: not set"),
    "missing zone for standard": ("v6e", {"gcp:zone": None}, "gcp:zone: not set; standard mode makes a zonal cluster"),
    "missing region for autopilot": (
        "v6e",
        {"mode": "autopilot", "gcp:region": None},
        "gcp:region: not set; autopilot mode makes a regional cluster",
    ),
    "zone outside region": (
        "v6e",
        {"gcp:zone": "europe-west4-a"},
        "gcp:zone: 'europe-west4-a' is not in gcp:region 'us-east5'",
    ),
    "missing token": ("v6e", {"hfToken": None}, "gemma-tpu:hfToken: not set; run: pulumi config set --secret hfToken"),
    "invalid bucket": (
        "v6e",
        {"bucketName": "My_Bucket!"},
        "gemma-tpu:bucketName: 'My_Bucket!' is not a valid bucket name",
    ),
    "google bucket": (
        "v6e",
        {"bucketName": "google-ckpt"},
        "gemma-tpu:bucketName: 'google-ckpt' is not a valid bucket name",
    ),
    "zero epochs": ("v6e", {"epochs": "0"}, "gemma-tpu:epochs: 0 must be at least 1"),
    "negative batch": ("v6e", {"batchSize": "-2"}, "gemma-tpu:batchSize: -2 must be at least 1"),
    "batch not integer": ("v6e", {"batchSize": "four"}, "gemma-tpu:batchSize: 'four' is not an integer"),
    "long ray cluster name": (
        "v6e",
        {"rayClusterName": "r" * 54},
        f"gemma-tpu:rayClusterName: '{'r' * 54}' must be a DNS-1035 label",
    ),
    "ray cluster name not DNS-1035": (
        "v6e",
        {"rayClusterName": "9ray"},
        "gemma-tpu:rayClusterName: '9ray' must be a DNS-1035 label",
    ),
    "long cluster name": (
        "v6e",
        {"clusterName": "c" * 41},
        f"gemma-tpu:clusterName: '{'c' * 41}' must be a GKE cluster name",
    ),
    "long namespace": (
        "v6e",
        {"namespace": "n" * 64},
        "gemma-tpu:namespace: '" + "n" * 64 + "' must be a DNS-1123 label",
    ),
    "version below ray add-on": (
        "v6e",
        {"clusterVersion": "1.29"},
        "gemma-tpu:clusterVersion: '1.29' is too old for v6e on standard GKE with the Ray add-on; need 1.30.0-gke.1747000",
    ),
    "full version below ray add-on": (
        "v6e",
        {"clusterVersion": "1.30.0-gke.1746999"},
        "need 1.30.0-gke.1747000 or newer",
    ),
    "ironwood standard": (
        "tpu7x",
        {"clusterVersion": "1.34.0-gke.2200000"},
        "'1.34.0-gke.2200000' is too old for tpu7x on standard GKE with the Ray add-on; need 1.34.0-gke.2201000",
    ),
    "ironwood autopilot": (
        "tpu7x",
        {"mode": "autopilot", "clusterVersion": "1.34.0-gke.2201000"},
        "is too old for tpu7x on autopilot GKE with the Ray add-on; need 1.34.1-gke.3084001",
    ),
    "ironwood minor": ("tpu7x", {"clusterVersion": "1.33"}, "'1.33' is too old for tpu7x"),
    "version garbage": (
        "v6e",
        {"clusterVersion": "latest-ish"},
        "gemma-tpu:clusterVersion: 'latest-ish' is not a GKE version",
    ),
}
# Typos and pasted values that would pass `preview` and fail only on the slice.
for value in ("nan", "inf", "1e309"):
    BAD[f"learning rate {value}"] = (
        "v6e",
        {"learningRate": value},
        f"gemma-tpu:learningRate: '{value}' must be a finite number",
    )
for value in ("-1", "0"):
    BAD[f"learning rate {value}"] = (
        "v6e",
        {"learningRate": value},
        f"gemma-tpu:learningRate: {float(value)} must be greater than 0",
    )
BAD["learning rate 2"] = ("v6e", {"learningRate": "2"}, "gemma-tpu:learningRate: 2.0 must be at most 1")
for value in ("", " ", "$(rm -rf /)", "ü", "n2-standard-8\n"):
    BAD[f"head machine {value!r}"] = (
        "v6e",
        {"headMachineType": value},
        f"gemma-tpu:headMachineType: {value!r} must be a GCE machine type",
    )
for name in ("model", "dataset"):
    for value in (" ", "\n", "$(rm -rf /)", "org/name with space", "a\tb"):
        BAD[f"{name} {value!r}"] = (
            "v6e",
            {name: value},
            f"gemma-tpu:{name}: {value!r} must be a hub id (org/name) or a path",
        )
for value in (" ", "\n", "$(rm -rf /)", "train[5]", "train[:10", "train +", ""):
    BAD[f"split {value!r}"] = (
        "v6e",
        {"datasetSplit": value},
        f"gemma-tpu:datasetSplit: {value!r} is not a split expression",
    )
for name in ("epochs", "batchSize", "seqLen"):
    BAD[f"huge {name}"] = (
        "v6e",
        {name: "9999999999999999999"},
        f"gemma-tpu:{name}: 9999999999999999999 must be at most",
    )
BAD["huge jobTimeoutMinutes"] = (
    "v6e",
    {"jobTimeoutMinutes": "9999999999999999999"},
    "gemma-tpu:jobTimeoutMinutes: 9999999999999999999 is more than",
)
BAD["negative maxFailures"] = ("v6e", {"maxFailures": "-1"}, "gemma-tpu:maxFailures: -1 must be at least 0")
BAD["huge maxFailures"] = (
    "v6e",
    {"maxFailures": "101"},
    "gemma-tpu:maxFailures: 101 must be at most 100 (each restart",
)
BAD["shardedCheckpoints not a boolean"] = ("v6e", {"shardedCheckpoints": "yes"}, "gemma-tpu:shardedCheckpoints: 'yes'")
# The recipe's keys: what the fine-tune would refuse on the slice, refused at preview.
BAD["unknown recipe"] = (
    "v6e",
    {"recipe": "fast"},
    "gemma-tpu:recipe: 'fast' is not one of default, walkthrough",
)
BAD["zero gradAccum"] = ("v6e", {"gradAccum": "0"}, "gemma-tpu:gradAccum: 0 must be at least 1")
BAD["warmup of 1"] = ("v6e", {"warmupRatio": "1"}, "gemma-tpu:warmupRatio: 1.0 must be below 1")
BAD["warmup of 1.5"] = ("v6e", {"warmupRatio": "1.5"}, "gemma-tpu:warmupRatio: 1.5 must be below 1")
BAD["negative warmup"] = ("v6e", {"warmupRatio": "-0.1"}, "gemma-tpu:warmupRatio: -0.1 must be at least 0")
BAD["warmup not a number"] = ("v6e", {"warmupRatio": "lots"}, "gemma-tpu:warmupRatio: 'lots' is not a number")
BAD["negative maxGradNorm"] = (
    "v6e",
    {"maxGradNorm": "-1"},
    "gemma-tpu:maxGradNorm: -1.0 must be at least 0",
)
BAD["nan maxGradNorm"] = ("v6e", {"maxGradNorm": "nan"}, "gemma-tpu:maxGradNorm: 'nan' must be a finite number")
BAD["unknown schedule"] = (
    "v6e",
    {"lrSchedule": "linear"},
    "gemma-tpu:lrSchedule: 'linear' is not one of cosine, constant",
)
BAD["negative lossChunk"] = ("v6e", {"lossChunk": "-1"}, "gemma-tpu:lossChunk: -1 must be at least 0")
BAD["eval overlaps"] = (
    "v6e",
    {"evalSplit": "train[1000:1100]"},
    "gemma-tpu:evalSplit: 'train[1000:1100]' overlaps gemma-tpu:datasetSplit 'train[:1024]'",
)
BAD["eval inside a whole split"] = ("v6e", {"datasetSplit": "train", "evalSplit": "train[:10]"}, "overlaps")
BAD["auto beside a split of several parts"] = (
    "v6e",
    {"datasetSplit": "train+test"},
    "gemma-tpu:evalSplit: 'auto' holds out records after the training slice or at its end, but gemma-tpu:datasetSplit "
    "'train+test' joins several",
)
BAD["dataset and datasetFile"] = (
    "v6e",
    {"dataset": "org/data", "datasetFile": "README.md"},
    "gemma-tpu:datasetFile and gemma-tpu:dataset are both set; the fine-tune reads one",
)
BAD["datasetFile not data"] = (
    "v6e",
    {"datasetFile": "README.md"},
    "gemma-tpu:datasetFile: 'README.md' must be a .json",
)
BAD["datasetFile missing"] = ("v6e", {"datasetFile": "nope.jsonl"}, "gemma-tpu:datasetFile: 'nope.jsonl' is not a file")
BAD["bad columns"] = (
    "v6e",
    {"datasetColumns": "question=prompt"},
    "gemma-tpu:datasetColumns: 'question=prompt' is not NEW=OLD pairs",
)
BAD["bad overlong"] = ("v6e", {"overlong": "wrap"}, "gemma-tpu:overlong: 'wrap' is not one of truncate, drop")
BAD["bad dataset config"] = (
    "v6e",
    {"datasetConfig": "a b"},
    "gemma-tpu:datasetConfig: 'a b' is not a configuration name",
)
BAD["eval garbage"] = ("v6e", {"evalSplit": "train[5]"}, "gemma-tpu:evalSplit: 'train[5]' is not auto, none or a split")
BAD["batch over a chip"] = (
    "v6e",
    {"batchSize": "64"},
    "It would fit with activationCheckpointing: true (15.9 GiB).",
)
BAD["sequence over a chip"] = (
    "v6e",
    {"seqLen": "131072", "batchSize": "1"},
    "gemma-tpu:model: google/gemma-4-E2B-it needs about 36",
)
BAD["step saves with full checkpoints"] = (
    "v6e",
    {"recipe": "walkthrough", "saveEvery": "100"},
    "gemma-tpu:saveEvery: 100 needs gemma-tpu:shardedCheckpoints (a full checkpoint restores",
)
BAD["negative max steps"] = ("v6e", {"maxSteps": "-1"}, "gemma-tpu:maxSteps: -1 must be at least 0")
BAD["timeout over a week"] = (
    "v6e",
    {"jobTimeoutMinutes": "10081"},
    "gemma-tpu:jobTimeoutMinutes: 10081 is more than 10080 (a week",
)
for value in ("127.0.0.1:8265", "anything", "ftp://h:1", "http://h:99999", "http:// h", "http://h/api?x=1"):
    BAD[f"ray address {value!r}"] = (
        "local",
        {"rayAddress": value, "gcp:project": None, "hfToken": None},
        f"gemma-tpu:rayAddress: {value!r} must be a Ray dashboard URL",
    )


@pytest.mark.parametrize("case", BAD)
def test_bad_input_fails_before_any_resource(case):
    stack, overrides, message = BAD[case]
    with pytest.raises(ConfigError) as err:
        run_program(stack, stack_config(stack, **overrides))
    assert message in str(err.value)
    assert run_program.last_registered == []


def test_good_versions_pass():
    for stack, mode, version in [
        ("tpu7x", "standard", "1.34.0-gke.2201000"),
        ("tpu7x", "autopilot", "1.34"),
        ("v6e", "standard", "1.30"),
    ]:
        run_program(stack, stack_config(stack, mode=mode, clusterVersion=version))


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        run_program("v6e", stack_config("v6e", tpuTopology="3x3", epochs="0", bucketName="UPPER", hfToken=None))
    assert len(err.value.problems) == 4


GOOD_JOB_VALUES = {
    "learningRate": ["2e-5", "1e-3", "0.5", "1"],
    "model": ["google/gemma-4-E2B-it", "gemma-4", "/models/gemma", "./m", "~/m", "gs-like.path/x_y"],
    "dataset": [
        "databricks/databricks-dolly-15k",
        "/data/dolly.jsonl",
        "../d.parquet",
        "gs://b-1/data/*.jsonl",
        "gs://bucket/x.parquet",
        "./data/part-*.jsonl",
    ],
    "datasetSplit": ["train[:1024]", "train[:90%]", "train[5:-100]"],
    "evalSplit": ["auto", "none", "train[1024:1088]", "test", "train[95%:]"],
    "epochs": ["1", "1000"],
    "batchSize": ["1", "8"],  # (more, and E2B outgrows a v6e chip: the memory plan refuses it)
    "seqLen": ["8", "512"],
    "maxFailures": ["0", "3", "100"],
}


@pytest.mark.parametrize("name", GOOD_JOB_VALUES)
def test_values_the_config_accepts_the_jobs_accept(name):
    """What passes validation reaches the fine-tune's own parser intact, and `datasets` parses the split."""
    from datasets import ReadInstruction

    from config.command_line import parse_args
    from infra.runner.ray_jobs import job_specs
    from infra.training import training_settings

    for value in GOOD_JOB_VALUES[name]:
        cfg = parse_as_cli({name: value})
        finetune = job_specs(training_settings(cfg), cfg.job.max_failures)[1]
        args = parse_args(list(finetune.args))
        assert (args.model, args.dataset, args.split) == (cfg.job.model, cfg.job.dataset, cfg.job.split)
        assert args.eval_split == cfg.job.eval_split
        assert (args.epochs, args.batch_size, args.seq_len) == (cfg.job.epochs, cfg.job.batch_size, cfg.job.seq_len)
        assert (args.lr, args.max_failures) == (cfg.job.lr, cfg.job.max_failures)
        for split in (args.split, args.eval_split):
            if split not in ("auto", "none"):
                ReadInstruction.from_spec(split)


def test_whole_splits_train_with_a_named_eval_split_or_none():
    for raw in ({"datasetSplit": "train", "evalSplit": "none"}, {"datasetSplit": "train+test", "evalSplit": "none"},
                {"datasetSplit": "train[10%:]", "evalSplit": "test"}, {"datasetSplit": "train[:90%]", "evalSplit": "train[90%:]"}):  # fmt: skip
        cfg = parse_as_cli(raw)
        assert (cfg.job.split, cfg.job.eval_split) == (raw["datasetSplit"], raw["evalSplit"])


def test_a_local_stack_takes_a_dashboard_url():
    for address in ("http://127.0.0.1:8265", "https://ray.example.com", "http://[::1]:8265/"):
        cfg = parse_as_cli(
            {"mode": "local", "rayAddress": address}, stack="l", project=None, zone=None, has_token=False
        )
        assert cfg.ray_address == address


# ---- config as the Pulumi CLI hands it over: every Pulumi.yaml default applied ----------------

DEFAULTED = [name for name, decl in config.declared_keys().items() if "default" in decl]


def _bases(data_file) -> dict[str, tuple[dict, dict]]:
    """Stacks a user writes, each as (raw config, parse's place arguments)."""
    gke = {"stack": "v6e", "project": "p", "region": None, "zone": "us-east5-b", "has_token": True}
    local = {"stack": "local", "project": None, "region": None, "zone": None, "has_token": False}
    return {
        "v6e": ({}, gke),
        "tpu7x autopilot": (
            {"tpuGeneration": "tpu7x", "tpuTopology": "2x2x2", "mode": "autopilot"},
            gke | {"region": "us-east5", "zone": None},
        ),  # fmt: skip
        "reservation": ({"reservation": "r1"}, gke),
        "spot": ({"spot": "true"}, gke),
        "flexStart": ({"capacity": "flexStart"}, gke),
        "datasetFile": ({"datasetFile": str(data_file)}, gke),
        "walkthrough, lora": ({"recipe": "walkthrough", "lora": "true", "evalSplit": "auto"}, gke),
        "local": ({"mode": "local", "datasetFile": str(data_file)}, local),
    }


@pytest.mark.parametrize("base", ["v6e", "tpu7x autopilot", "reservation", "spot", "flexStart", "datasetFile",
                                  "walkthrough, lora", "local"])  # fmt: skip
def test_a_declared_default_changes_no_decision(base, tmp_path):
    """Parsing a stack as written equals parsing it as the CLI delivers it (each default applied), key by key:
    no decision may hang on whether a key with a declared default was given."""
    data = tmp_path / "records.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    raw, place = _bases(data)[base]
    as_written = config.parse(raw, **place)
    for name in DEFAULTED:
        if name not in raw:
            with_default = raw | {name: as_cli({}).get(name)}
            assert config.parse(with_default, **place) == as_written, f"{name}'s declared default changed the config"
    assert config.parse(as_cli(raw), **place) == as_written


def test_only_keys_without_a_default_can_be_asked_whether_they_were_given():
    reader = Reader({})
    assert reader.given("capacity") is None and reader.given("dataset") is None
    with pytest.raises(AssertionError, match="epochs has a default in Pulumi.yaml"):
        reader.given("epochs")


def test_a_dataset_file_alone_is_read_under_the_clis_defaults(tmp_path):
    data = tmp_path / "records.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = parse_as_cli({"datasetFile": str(data)})
    assert cfg.dataset_file == str(data)
    assert cfg.job.dataset.startswith("gs://p-v6e-checkpoints/datasets/records-")  # the uploaded copy
    assert parse_as_cli({}).job.dataset == "databricks/databricks-dolly-15k"  # the walkthrough's, unset
    assert (cfg.job.split, parse_as_cli({}).job.split) == ("train", "train[:1024]")  # all of the user's own file
    assert parse_as_cli({"datasetFile": str(data), "datasetSplit": "train[:10]"}).job.split == "train[:10]"
    with pytest.raises(ConfigError, match="datasetFile and gemma-tpu:dataset are both set"):
        parse_as_cli({"datasetFile": str(data), "dataset": "databricks/databricks-dolly-15k"})


def test_a_reservation_keeps_the_slice_up_unless_scale_to_zero_is_set():
    assert parse_as_cli({"reservation": "r1"}).capacity.scale_to_zero is False
    assert parse_as_cli({"reservation": "r1", "scaleToZero": "true"}).capacity.scale_to_zero is True
    assert parse_as_cli({}).capacity.scale_to_zero is True
    assert parse_as_cli({"scaleToZero": "false"}).capacity.scale_to_zero is False


def test_full_checkpoints_save_at_epoch_ends_unless_told_otherwise():
    cfg = parse_as_cli({"shardedCheckpoints": "false"})
    assert (cfg.job.save_every, cfg.job.eval_every) == (0, 500)
