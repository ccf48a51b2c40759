"""The fine-tune's settings as the stack will send them, read from the stack's config by the job's own
declarations (jobs/config/settings.py): each setting a stack key exposes, by its declared type; a recipe setting left
unset from the recipe; the placement and the storage from the stack's own keys. Then the job's own checks
(setting_checks.problems), said in the stack's words: what the job would refuse, the stack refuses at preview,
naming the key.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from infra import ROOT
from infra.cloud.tpu import TpuSlice
from infra.config.reader import Reader, key
from infra.job_modules import reward_specs, setting_checks, settings

# A datasetFile's object in the bucket (infra/resources/dataset.py uploads it): its name carries the file's content
# hash, so an edited file is a new object and a new gs:// URI in the job's arguments (a new run).
DATASETS_PREFIX = "datasets"


def object_name(path: str) -> str:
    """datasets/<stem>-<sha256, 16 hex>.<suffix>"""
    file = Path(path)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    return f"{DATASETS_PREFIX}/{file.stem}-{digest}{file.suffix}"


def dataset_ref(dataset: str, dataset_file: str, bucket_name: str | None) -> str:
    """What the fine-tune reads: `dataset`, or `dataset_file` uploaded to `bucket_name` (None: read in
    place, as local mode does)."""
    if not dataset_file:
        return dataset
    if bucket_name is None:
        return dataset_file
    return f"gs://{bucket_name}/{object_name(dataset_file)}"


CHECKPOINT_PREFIX = "ray_train_torchtpu"  # the walkthrough's prefix in the bucket
# The stack's keys behind the settings it derives rather than exposes.
DERIVED_KEYS = {"topology": "tpuTopology", "accelerator_type": "tpuGeneration", "num_workers": "finetuneWorkers",
                "backend": "mode", "storage_path": "bucketName"}  # fmt: skip


def key_of(name: str) -> str:
    """The stack key a setting's value comes from."""
    return key(settings.stack_keys().get(name) or DERIVED_KEYS.get(name, name))


def _cast(kind: type):
    if kind is bool:
        return lambda text: {"true": True, "false": False}[text.lower()]
    return kind


def read(r: Reader, name: str):
    """A setting's value from its key: the given one (or the CLI's default); None when the key declares no
    default and is not set (the recipe's, or the setting's own default, then)."""
    stack_key = settings.stack_keys()[name]
    if "default" not in r.decl[stack_key] and r.given(stack_key) is None:
        return None
    text, kind = r.value(stack_key), settings.value_type(name)
    optional = settings.SETTINGS[name].default is None and settings.declared(settings.SETTINGS[name]).stack_default
    if text == "" and optional:
        return None  # an empty string: no value (datasetConfig, epsilonHigh; not datasetSplit, derived when unset)
    what = {int: "an integer", float: "a number", bool: "true or false", str: "text"}[kind]
    try:
        return _cast(kind)(text)
    except (ValueError, KeyError):
        r.problem(f"{key(stack_key)}: {text!r} is not {what}")
        return settings.SETTINGS[name].default


def job_settings(r: Reader, *, local: bool, tpu_slice: TpuSlice | None, bucket: str, dataset_file: str,
                 local_storage: str, workers: int) -> settings.FinetuneSettings:  # fmt: skip
    """The settings the fine-tune gets (its run name is the job resource's to give), checked by the job's rules."""
    values = {name: read(r, name) for name in settings.stack_keys()}
    values = settings.with_recipe(values, values["recipe"] if values["recipe"] in settings.RECIPES else "default")
    values = {n: v for n, v in values.items() if v is not None}
    if local:
        placement = {"backend": "cpu", "num_workers": workers, "storage_path": local_storage}
    else:
        placement = {"backend": "tpu", "storage_path": f"gs://{bucket}/{CHECKPOINT_PREFIX}"}
        if tpu_slice is not None:
            placement |= {"topology": tpu_slice.topology,
                          "accelerator_type": tpu_slice.generation.ray_accelerator_type}  # fmt: skip
    if dataset_file:
        values["dataset"] = dataset_ref("", dataset_file, None if local else bucket)
    if local:  # the local stack names files of this checkout; the jobs run elsewhere, so make them absolute
        values |= {n: local_path(values[n]) for n in ("model", "dataset") if n in values}
    if values.get("objective") == "grpo" and "rewards" in values:
        values["rewards"] = reward_files(r, values["rewards"], local)
    job = settings.FinetuneSettings(**values | placement)  # after the dataset: a file's default split is all of it
    for problem in setting_checks.problems(job):
        r.problem(f"{key_of(problem.name)}: {_as_given(r, problem)!r} {problem.render(key_of)}")
    return job


def reward_files(r: Reader, rewards: str, local: bool) -> str:
    """`rewards` with each FILE.py entry made absolute (local) or refused unless on gs:// (the job runs on the
    cluster, which cannot read this machine's files)."""
    out = []
    for entry in reward_specs.entries(rewards):
        parts = reward_specs.file_and_function(entry)
        if parts and local:
            entry = f"{local_path(parts[0])}:{parts[1]}"
        elif parts and not parts[0].startswith("gs://"):
            r.problem(f"{key('rewards')}: {entry!r} is a file on this machine, which the cluster's job cannot read: "
                      f"copy it to the bucket (gcloud storage cp {parts[0]} gs://BUCKET/rewards/) and name "
                      f"gs://BUCKET/rewards/{parts[0].rsplit('/', 1)[-1]}:{parts[1]}")  # fmt: skip
        out.append(entry)
    return ",".join(out)


def _as_given(r: Reader, problem: setting_checks.Problem):
    """The refused value as the user wrote it where parsing changed it past recognition (1e309 reads as inf)."""
    stack_key = settings.stack_keys().get(problem.name)
    if isinstance(problem.value, float) and not math.isfinite(problem.value) and stack_key:
        return r.value(stack_key)
    return problem.value


def local_path(ref: str) -> str:
    path = ROOT / ref
    return str(path) if not Path(ref).is_absolute() and (ref.startswith(".") or path.exists()) else ref
