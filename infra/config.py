"""The stack's settings: read once, validated once, frozen, before any resource exists.

Keys, types and defaults live in Pulumi.yaml's `config:` block (so `pulumi config`
documents them); this module reads that block instead of repeating it. `parse` runs one
checker per concern (mode and place, TPU, names, jobs); each adds what it finds wrong to
one list, so every problem is reported together.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path

import yaml
from data_formats import COLUMNS, DEFAULT_DATASET, LOCAL_DATA, OVERLONG
from recipe import RECIPES, SCHEDULES, Recipe, with_recipe

from infra import PROJECT, PULUMI_YAML, ROOT
from infra.capacity import (
    CAPACITIES,
    FLEX_START_MAX_RUN_MINUTES,
    FLEX_START_MIN_GKE,
    HEAD_RESOURCES,
    RESERVATION,
    SPOT_GRACE_MIN_GKE,
    SliceCapacity,
    flex_start_run_minutes,
)
from infra.splits import absolute_slice, is_split
from infra.tpu import GENERATIONS, TpuSlice, is_topology

MODES = ("standard", "autopilot", "local")
GKE_MODES = ("standard", "autopilot")

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][-a-z0-9_.]{1,61}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_ZONE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+)-gke\.(\d+))?$")
# GCE machine types: family-kind-size words (n2-standard-8, c3-highmem-4-lssd, n1-custom-4-8192).
_MACHINE_TYPE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+){1,4}$")
# A hub id (org/name, as the Hugging Face hub spells them) or a path: no whitespace, control
# characters or shell syntax, which no repository or file the jobs load can contain.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_PATH = re.compile(r"^(~|\.{1,2})?/?[A-Za-z0-9._+@=,-]+(/[A-Za-z0-9._+@=,-]+)*/?$")
# Data may also be gs:// objects, and files or objects named by a glob.
_DATA_PATH = re.compile(r"^((~|\.{1,2})?/?|gs://)[A-Za-z0-9._+@=,*?-]+(/[A-Za-z0-9._+@=,*?\[\]-]+)*/?$")
# --columns: NEW=OLD pairs onto the record formats' column names
_COLUMN_PAIR = rf"({'|'.join(COLUMNS)})=[^\s,=]+"
_COLUMNS = re.compile(rf"^{_COLUMN_PAIR}(,{_COLUMN_PAIR})*$")

# Upper bounds, each with why: values past them cannot be what a user meant.
JOB_LIMITS = {
    "epochs": (1000, "more epochs than any fine-tune of this size needs"),
    "batchSize": (1024, "per device; a TPU device's memory holds far fewer Gemma 4 sequences"),
    "seqLen": (131072, "Gemma 4's longest context"),
    "jobTimeoutMinutes": (10080, "a week; the job resource waits this long, twice, for its jobs"),
    "sliceReadyTimeoutMinutes": (1440, "a day; GKE adds a slice within minutes when capacity exists"),
    "collectivesWorkers": (256, "local mode runs one CPU process per worker"),
    "finetuneWorkers": (256, "local mode runs one CPU process per worker"),
    "maxFailures": (100, "each restart reloads the model; a run failing this often has a cause to fix first"),
    "gradAccum": (1024, "micro-batches per step; a global batch this large is rarely what a fine-tune wants"),
    "lossChunk": (1048576, "tokens per chunk; more than a step holds is the full logits anyway"),
    "maxSteps": (10_000_000, "ten million optimizer steps; no fine-tune of this size runs that long"),
    "saveEvery": (10_000_000, "optimizer steps between checkpoints; 0 saves at epoch ends only"),
    "evalEvery": (10_000_000, "optimizer steps between evals; 0 evaluates at epoch ends only"),
    "evalSamples": (64, "prompts every rank answers in one batch at each eval, 128 tokens each"),
    "loraRank": (1024, "far past what LoRA fine-tunes use (8 to 64)"),
    "loraAlpha": (4096, "the adapters' scale is alpha / rank"),
    "headCpus": (int(HEAD_RESOURCES["cpu"]), f"the head pod requests {HEAD_RESOURCES['cpu']} CPUs"),
}


# GKE's nodes per cluster before a quota lift ("Nodes per cluster", cloud.google.com/kubernetes-engine/quotas,
# read 2026-12); one of them is the head's node.
MAX_CLUSTER_NODES = 5000
COMPILE_CACHE_PREFIX = "torch_tpu_compile_cache"


class ConfigError(ValueError):
    """Every problem found in the stack's config, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid stack config:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class JobSettings:
    model: str
    dataset: str
    dataset_split: str
    epochs: int
    batch_size: int
    seq_len: int
    max_failures: int
    max_steps: int  # 0: epochs decide
    learning_rate: float
    timeout_minutes: int
    recipe: str
    grad_accum: int
    activation_checkpointing: bool
    lora: bool
    lora_rank: int
    lora_alpha: int
    dataset_file: str  # a local file the stack uploads to its bucket ("" for none)
    dataset_config: str
    dataset_columns: str
    overlong: str
    recipe_settings: Recipe  # each recipe key (jobs/recipe.py): the stack's value, else the named recipe's
    # local mode only
    collectives_workers: int
    finetune_workers: int
    local_storage_path: str


@dataclass(frozen=True)
class StackConfig:
    stack: str
    project: str | None  # None in local mode only
    region: str | None
    zone: str | None
    mode: str
    slice: TpuSlice  # one slice; there are num_slices of it
    num_slices: int
    capacity: SliceCapacity  # where the slice's TPUs come from, and whether it scales to zero
    price_per_chip_hour: float | None  # a negotiated price, over the prices table
    slice_ready_timeout_minutes: int
    cluster_name: str
    cluster_version: str
    head_machine_type: str
    deletion_protection: bool
    bucket_name: str
    bucket_force_destroy: bool
    repository: str
    image_name: str
    ray_cluster_name: str
    head_cpus: int  # the Ray head's num-cpus: what the data preparation may use there
    defer_and_fuse: bool  # TorchTPU's TORCH_TPU_DEFER_AND_FUSE on the TPU workers
    compile_cache: bool  # TorchTPU's tier-3 compile cache in the bucket
    namespace: str
    service_account: str
    job: JobSettings
    ray_address: str  # local mode only

    @property
    def local(self) -> bool:
        return self.mode == "local"

    @property
    def autopilot(self) -> bool:
        return self.mode == "autopilot"

    @property
    def compile_cache_root(self) -> str:
        """Where TorchTPU keeps compiled programs across pods and runs ("" for none): the bucket."""
        return f"gs://{self.bucket_name}/{COMPILE_CACHE_PREFIX}" if self.compile_cache and not self.local else ""

    @property
    def chips(self) -> int:
        """Every slice's chips: what the run bills."""
        return self.slice.chips * self.num_slices

    @property
    def hosts(self) -> int:
        return self.slice.hosts * self.num_slices

    @property
    def devices(self) -> int:
        """Every slice's devices: the Ray workers, and the data parallelism of the run."""
        return self.slice.devices * self.num_slices

    @property
    def location(self) -> str:
        """Where the cluster lives: a region for Autopilot, a zone for Standard."""
        return self.region if self.autopilot else self.zone  # type: ignore[return-value]


@cache
def declared_keys() -> dict[str, dict]:
    """The project's config keys as Pulumi.yaml declares them (type, default, description)."""
    return yaml.safe_load(PULUMI_YAML.read_text())["config"]


def secret_keys() -> list[str]:
    return [name for name, decl in declared_keys().items() if decl.get("secret")]


def _local_path(ref: str) -> str:
    path = ROOT / ref
    return str(path) if not Path(ref).is_absolute() and (ref.startswith(".") or path.exists()) else ref


def key(name: str) -> str:
    return f"{PROJECT}:{name}"


def parse_version(text: str) -> tuple[int, ...] | None:
    m = _VERSION.fullmatch(text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def version_at_least(version: str, minimum: str) -> bool:
    """MAJOR.MINOR means GKE's current patch of that minor, so only the minor is compared."""
    have, need = parse_version(version), parse_version(minimum)
    return have[:2] >= need[:2] if len(have) == 2 else have >= need


def is_model_ref(text: str) -> bool:
    """A hub id (`org/name`) or a path; whitespace, control characters and shell syntax never are."""
    return bool(_HUB_ID.fullmatch(text) or _PATH.fullmatch(text))


def is_data_ref(text: str) -> bool:
    """A hub id, a path or glob, or a gs:// object or glob."""
    return bool(_HUB_ID.fullmatch(text) or _DATA_PATH.fullmatch(text))


def is_http_url(text: str) -> bool:
    try:
        url = urllib.parse.urlsplit(text)
        url.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError:
        return False
    host_ok = bool(url.hostname) and re.fullmatch(r"[A-Za-z0-9.:-]+", url.hostname) is not None
    return url.scheme in ("http", "https") and host_ok and url.path in ("", "/") and not url.query


class _Reader:
    """Raw config strings, the declared defaults, and the problems found so far."""

    def __init__(self, raw: Mapping[str, str | None]):
        self.raw, self.decl, self.problems = raw, declared_keys(), []

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def given(self, name: str) -> str | None:
        """The key's value if the user set it, else None. Only for keys without a declared default: the
        Pulumi CLI applies every Pulumi.yaml default before the program runs (pulumi/pulumi
        sdk/go/common/workspace, mergeConfig), so a key with one is never unset there."""
        if "default" in self.decl[name]:
            raise AssertionError(f"{name} has a default in Pulumi.yaml: whether it was given cannot be known")
        return self.raw.get(name)

    def value(self, name: str) -> str:
        v = self.raw.get(name)
        if v is None:
            default = self.decl[name].get("default")
            return "" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        return str(v)

    def typed(self, name: str, cast: Callable[[str], object]):
        text = self.value(name)
        try:
            return cast(text)
        except ValueError:
            self.problem(f"{key(name)}: {text!r} is not {self.decl[name]['type']}")
            return None

    def boolean(self, name: str) -> bool:
        def cast(text: str) -> bool:
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"

        return bool(self.typed(name, cast))

    def positive(self, name: str, minimum: int = 1) -> int:
        n = self.typed(name, int)
        limit, why = JOB_LIMITS.get(name, (None, ""))
        if n is not None and n < minimum:
            self.problem(f"{key(name)}: {n} must be {'a positive integer' if minimum == 1 else f'at least {minimum}'}")
        elif n is not None and limit is not None and n > limit:
            self.problem(f"{key(name)}: {n} is more than {limit} ({why})")
        return n or 0

    def name(self, name: str, pattern: re.Pattern, limit: int, what: str) -> str:
        text = self.value(name)
        if len(text) > limit or not pattern.fullmatch(text):
            self.problem(f"{key(name)}: {text!r} must be {what} of at most {limit} characters")
        return text


def _mode(r: _Reader) -> str:
    mode = r.value("mode")
    if mode not in MODES:
        r.problem(f"{key('mode')}: {mode!r} is not a mode; allowed: {', '.join(MODES)}")
    return mode


def _tpu_slice(r: _Reader) -> TpuSlice | None:
    gen_name, topology = r.value("tpuGeneration"), r.value("tpuTopology")
    generation = GENERATIONS.get(gen_name)
    if generation is None:
        r.problem(
            f"{key('tpuGeneration')}: {gen_name!r} is not a known TPU generation; allowed: {', '.join(GENERATIONS)}"
        )
        return None
    if topology not in generation.topologies:
        why = "is not a topology" if not is_topology(topology) else f"is not a {gen_name} multi-host topology"
        r.problem(
            f"{key('tpuTopology')}: {topology!r} {why}; allowed for {gen_name}: {', '.join(generation.topologies)}"
        )
        return None
    return TpuSlice(generation, topology)


def _num_slices(r: _Reader, tpu_slice: TpuSlice | None, mode: str, job: JobSettings) -> int:
    """Slices of the topology: as many as a cluster's nodes hold; in local mode, groups of the CPU workers."""
    n = r.positive("numSlices")
    if n > 1 and mode == "local":
        for name, workers in (
            ("finetuneWorkers", job.finetune_workers),
            ("collectivesWorkers", job.collectives_workers),
        ):
            if workers % n:
                r.problem(f"{key('numSlices')}: {n} does not divide {key(name)} {workers}: local mode stands in for "
                          f"each slice with an equal group of CPU workers; set {name} to a multiple of {n}")  # fmt: skip
    elif n > 1 and tpu_slice is not None:
        most = (MAX_CLUSTER_NODES - 1) // tpu_slice.hosts
        if n > most:
            r.problem(f"{key('numSlices')}: {n} slices of {tpu_slice.generation.name} {tpu_slice.topology} are "
                      f"{n * tpu_slice.hosts} TPU hosts, past GKE's {MAX_CLUSTER_NODES} nodes a cluster (one is the "
                      f"head's): at most {most}, or a larger tpuTopology")  # fmt: skip
    return n


def _place(r: _Reader, mode: str, project: str | None, region: str | None, zone: str | None) -> str | None:
    """Checks project, region and zone for the mode; returns the region (derived from the zone if unset)."""
    local = mode == "local"
    if not project and not local:
        r.problem("gcp:project: not set; run: pulumi config set gcp:project PROJECT_ID")
    if region and not _REGION.fullmatch(region):
        r.problem(f"gcp:region: {region!r} is not a region name such as us-east5")
        region = None
    zone_match = _ZONE.fullmatch(zone) if zone else None
    if zone and not zone_match:
        r.problem(f"gcp:zone: {zone!r} is not a zone name such as us-east5-b")
    if mode == "standard":
        if not zone:
            r.problem("gcp:zone: not set; standard mode makes a zonal cluster: pulumi config set gcp:zone ZONE")
        elif zone_match:
            if region and zone_match.group(1) != region:
                r.problem(f"gcp:zone: {zone!r} is not in gcp:region {region!r}")
            region = region or zone_match.group(1)
    elif mode == "autopilot" and not region:
        r.problem("gcp:region: not set; autopilot mode makes a regional cluster: pulumi config set gcp:region REGION")
    return region


def _capacity(r: _Reader, mode: str) -> tuple[str, str]:
    """capacity, with the older `spot` and `reservation` keys mapped onto it; returns (capacity, reservation)."""
    spot = r.boolean("spot")
    reservation = r.value("reservation")
    given = r.given("capacity")
    if reservation and not RESERVATION.fullmatch(reservation):
        r.problem(f"{key('reservation')}: {reservation!r} must be NAME or projects/PROJECT/reservations/NAME")
    if given is not None and given not in CAPACITIES:
        r.problem(f"{key('capacity')}: {given!r} is not a capacity kind; allowed: {', '.join(CAPACITIES)}")
        return "onDemand", reservation
    implied = "spot" if spot else "reservation" if reservation else None
    if mode == "local" and (spot or reservation or given not in (None, "onDemand")):
        r.problem(
            f"{key('mode')}: 'local' runs no TPU; unset {key('capacity')}, {key('spot')} and {key('reservation')} for it"
        )
    elif spot and reservation:
        r.problem(
            f"{key('spot')}: true cannot be combined with {key('reservation')} {reservation!r}: Spot VMs do not consume reservations; unset one"
        )
    elif given is not None and implied is not None and given != implied:
        r.problem(f"{key('capacity')}: {given!r} contradicts {key('spot' if spot else 'reservation')} "
                  f"({'true' if spot else repr(reservation)}), which means {implied!r}; set one of them")  # fmt: skip
    elif given == "reservation" and not reservation:
        r.problem(
            f"{key('capacity')}: 'reservation' needs {key('reservation')}: NAME or projects/PROJECT/reservations/NAME"
        )
    capacity = given or implied or "onDemand"
    return capacity, reservation


def _flex_start(
    r: _Reader, capacity: str, scale_to_zero: bool, version: str, job_timeout: int, ready_timeout: int
) -> None:
    if capacity != "flexStart":
        return
    if not scale_to_zero:
        r.problem(
            f"{key('capacity')}: flexStart gets its capacity when the job resource scales the slice up; "
            f"it needs {key('scaleToZero')}: true"
        )
    if parse_version(version) is not None and not version_at_least(version, FLEX_START_MIN_GKE):
        r.problem(
            f"{key('clusterVersion')}: {version!r} is too old for TPU flex-start; need {FLEX_START_MIN_GKE} or newer"
        )
    if flex_start_run_minutes(job_timeout, ready_timeout) > FLEX_START_MAX_RUN_MINUTES:
        r.problem(
            f"{key('jobTimeoutMinutes')}: {job_timeout} is too long for flex-start, whose nodes run at most 7 days "
            f"(the slice must outlive the data check, the collectives check and the fine-tune, each up to jobTimeoutMinutes)"
        )


def _spot_grace(r: _Reader, capacity: str, mode: str, version: str) -> None:
    """A Standard Spot pool raises its kubelet's shutdown grace (infra/capacity.py), which GKE allows from a
    given control-plane version: older, a preempted pod would get 15 s, too few to save a step."""
    if capacity == "spot" and mode == "standard" and parse_version(version) is not None:
        if not version_at_least(version, SPOT_GRACE_MIN_GKE):
            r.problem(f"{key('clusterVersion')}: {version!r} cannot give Spot pods more than 15 s to save before a "
                      f"preemption; need {SPOT_GRACE_MIN_GKE} or newer (GKE's Spot shutdown grace), or another "
                      f"{key('capacity')}")  # fmt: skip


def _price(r: _Reader) -> float | None:
    text = r.value("pricePerChipHour")
    if not text:
        return None
    price = r.typed("pricePerChipHour", float)
    if price is not None and not (math.isfinite(price) and 0 <= price < 1000):
        r.problem(f"{key('pricePerChipHour')}: {text!r} must be a price in USD per chip-hour, such as 2.70")
        return None
    return price


def _scale_to_zero(r: _Reader, reservation: str) -> bool:
    """Default true, but false with a reservation: reserved capacity is paid whether nodes exist or not,
    so scaling to zero would save nothing and cost a provisioning wait per run."""
    if r.given("scaleToZero") is None:
        return not reservation
    return r.boolean("scaleToZero")


def _cluster_version(r: _Reader, mode: str, tpu_slice: TpuSlice | None) -> str:
    version = r.value("clusterVersion")
    if parse_version(version) is None:
        r.problem(f"{key('clusterVersion')}: {version!r} is not a GKE version; use MAJOR.MINOR (1.36) or 1.36.X-gke.N")
    elif tpu_slice is not None and mode in GKE_MODES:
        generation = tpu_slice.generation
        minimum = generation.min_gke_autopilot if mode == "autopilot" else generation.min_gke_standard
        if not version_at_least(version, minimum):
            r.problem(
                f"{key('clusterVersion')}: {version!r} is too old for {generation.name} on {mode} GKE with the Ray add-on; need {minimum} or newer"
            )
    return version


def _bucket(r: _Reader, stack: str, project: str | None, local: bool) -> str:
    bucket = r.value("bucketName") or (f"{project}-{stack}-checkpoints" if project and not local else "")
    if bucket and (not _BUCKET.fullmatch(bucket) or ".." in bucket or bucket.startswith("goog") or "google" in bucket):
        r.problem(
            f"{key('bucketName')}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 - _ ., "
            "starting and ending with a letter or digit, no 'goog' prefix or 'google')"
        )
    return bucket


def _learning_rate(r: _Reader) -> float:
    text = r.value("learningRate")
    rate = r.typed("learningRate", float)
    if rate is not None and not (math.isfinite(rate) and 0 < rate <= 1):
        r.problem(f"{key('learningRate')}: {text!r} must be a finite number greater than 0 and at most 1")
        return 0.0
    return rate or 0.0


def _job(r: _Reader, local: bool) -> JobSettings:
    dataset = r.given("dataset")
    refs = {"model": r.value("model"), "dataset": DEFAULT_DATASET if dataset is None else dataset}
    for name, valid, what in (("model", is_model_ref, "a path"), ("dataset", is_data_ref, "a path, glob or gs:// URI")):
        text = refs[name]
        if not valid(text):
            r.problem(
                f"{key(name)}: {text!r} must be a hub id (org/name) or {what}, without whitespace, "
                "control characters or shell syntax"
            )
    split = _split(r, "datasetSplit")
    recipe = _recipe(r)
    dataset_file = _dataset_file(r)
    job = JobSettings(
        model=refs["model"],
        dataset=refs["dataset"],
        dataset_split=split,
        epochs=r.positive("epochs"),
        batch_size=r.positive("batchSize"),
        seq_len=r.positive("seqLen"),
        max_failures=r.positive("maxFailures", minimum=0),
        max_steps=r.positive("maxSteps", minimum=0),
        learning_rate=_learning_rate(r),
        timeout_minutes=r.positive("jobTimeoutMinutes"),
        recipe=recipe,
        grad_accum=r.positive("gradAccum"),
        activation_checkpointing=r.boolean("activationCheckpointing"),
        lora=r.boolean("lora"),
        lora_rank=r.positive("loraRank"),
        lora_alpha=r.positive("loraAlpha"),
        dataset_file=dataset_file,
        dataset_config=_dataset_config(r),
        dataset_columns=_dataset_columns(r),
        overlong=_overlong(r),
        collectives_workers=r.positive("collectivesWorkers"),
        finetune_workers=r.positive("finetuneWorkers"),
        local_storage_path=str(ROOT / r.value("localStoragePath")),
        recipe_settings=_recipe_keys(r, recipe, split),
    )
    if local:
        # The local stack names files of this checkout; the jobs run elsewhere, so make them absolute.
        job = replace(job, model=_local_path(job.model), dataset=_local_path(job.dataset))
        address = r.value("rayAddress")
        if not is_http_url(address):
            r.problem(f"{key('rayAddress')}: {address!r} must be a Ray dashboard URL such as http://127.0.0.1:8265")
    return job


def _dataset_file(r: _Reader) -> str:
    """datasetFile: a local data file (relative to this directory), uploaded by the stack; not with dataset."""
    text = r.value("datasetFile")
    if not text:
        return ""
    if r.given("dataset") is not None:
        r.problem(
            f"{key('datasetFile')} and {key('dataset')} are both set; the fine-tune reads one: "
            f"unset one (pulumi config rm {key('dataset')})"
        )
    path = Path(text).expanduser()
    path = path if path.is_absolute() else ROOT / path
    if path.suffix not in LOCAL_DATA:
        r.problem(f"{key('datasetFile')}: {text!r} must be a {', '.join(LOCAL_DATA)} file")
    elif not path.is_file() or path.stat().st_size == 0:
        r.problem(f"{key('datasetFile')}: {text!r} is not a file with records (looked at {path})")
    return str(path)


def _dataset_config(r: _Reader) -> str:
    text = r.value("datasetConfig")
    if text and not re.fullmatch(r"[A-Za-z0-9._-]+", text):
        r.problem(f"{key('datasetConfig')}: {text!r} must be a dataset configuration name such as 'en'")
    return text


def _dataset_columns(r: _Reader) -> str:
    text = r.value("datasetColumns")
    if text and not _COLUMNS.fullmatch(text):
        r.problem(
            f"{key('datasetColumns')}: {text!r} must be NEW=OLD pairs such as prompt=question,completion=answer, "
            "NEW one of messages, prompt, completion, instruction, context, response"
        )
    return text


def _overlong(r: _Reader) -> str:
    text = r.value("overlong")
    if text not in OVERLONG:
        r.problem(f"{key('overlong')}: {text!r} must be one of {', '.join(OVERLONG)}")
    return text


def _split(r: _Reader, name: str) -> str:
    split = r.value(name)
    if not is_split(split):
        r.problem(
            f"{key(name)}: {split!r} is not a split expression such as train, train[:1024], train[10%:] or train+test"
        )
    return split


def _recipe(r: _Reader) -> str:
    recipe = r.value("recipe")
    if recipe not in RECIPES:
        r.problem(f"{key('recipe')}: {recipe!r} is not a recipe; allowed: {', '.join(RECIPES)}")
        return "default"
    return recipe


def config_key(field_name: str) -> str:
    """The stack config key of a recipe field: warmup_ratio -> warmupRatio."""
    first, *rest = field_name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def _recipe_keys(r: _Reader, recipe: str, split: str) -> Recipe:
    """Each recipe key as the stack sets it (read by its type in jobs/recipe.py), else the recipe's."""
    readers = {"bool": r.boolean, "str": r.value, "float": lambda n: r.typed(n, float),
               "int": lambda n: r.positive(n, minimum=0)}  # fmt: skip
    given = {}
    for f in fields(Recipe):
        if r.given(config_key(f.name)) is not None:
            given[f.name] = readers[getattr(f.type, "__name__", f.type)](config_key(f.name))
    values = with_recipe(given, recipe)
    if values["lr_schedule"] not in SCHEDULES:
        r.problem(f"{key('lrSchedule')}: {values['lr_schedule']!r} is not a schedule; allowed: {', '.join(SCHEDULES)}")
    if values["warmup_ratio"] is not None and not 0 <= values["warmup_ratio"] < 1:
        r.problem(
            f"{key('warmupRatio')}: {values['warmup_ratio']} must be at least 0 and below 1 (a share of the steps)"
        )
    if values["max_grad_norm"] is not None and not values["max_grad_norm"] >= 0:
        r.problem(f"{key('maxGradNorm')}: {values['max_grad_norm']} must be 0 (no clipping) or more")
    _eval_split(r, values["eval_split"], split)
    if values["save_every"] and not values["sharded_checkpoints"]:
        r.problem(f"{key('saveEvery')}: {values['save_every']} needs {key('shardedCheckpoints')} true (a full checkpoint "
                  "restores the weights only, so a run could not go on from the middle of an epoch); or set it to 0")  # fmt: skip
    return Recipe(**values)


def _eval_split(r: _Reader, eval_split: str, split: str) -> None:
    """The held-out split: auto, none or a split expression that never overlaps the training one.
    Checked here where the numbers are absolute; the job checks the rest against the data itself."""
    if eval_split in ("auto", "none"):
        bounds = absolute_slice(split)
        if eval_split == "auto" and ("+" in split or (bounds and bounds[2] == math.inf)):
            r.problem(
                f"{key('evalSplit')}: auto holds out the records after the training slice, but "
                f"{key('datasetSplit')} {split!r} has no end; set datasetSplit to a slice such as train[:95%] "
                "and evalSplit to train[95%:], or evalSplit to none"
            )
        return
    if not is_split(eval_split):
        r.problem(
            f"{key('evalSplit')}: {eval_split!r} is not auto, none or a split expression such as train[1024:1088]"
        )
        return
    for held in map(absolute_slice, eval_split.split("+")):
        for trained in map(absolute_slice, split.split("+")):
            if held and trained and held[0] == trained[0]:
                (_, a, b), (_, c, d) = held, trained
                if a < d and c < b:
                    r.problem(
                        f"{key('evalSplit')}: {eval_split!r} overlaps {key('datasetSplit')} {split!r}; "
                        "held-out records must not be trained on"
                    )
                    return


def _memory(r: _Reader, tpu_slice: TpuSlice, job: JobSettings) -> None:
    """A Gemma 4 size the table knows must fit the slice's device memory, or the preview names what would."""
    from infra.models import memory_plan, memory_remedy

    needed = memory_plan(job, tpu_slice)
    if needed is None or needed.fits:
        return
    parts = ", ".join(f"{k} {v:.1f}" for k, v in needed.parts.items())
    advice = memory_remedy(job, tpu_slice)
    r.problem(
        f"{key('model')}: {job.model} needs about {needed.total_gib:.1f} GiB per device on "
        f"{tpu_slice.generation.name} {tpu_slice.topology} ({needed.hbm_gib:g} GiB a device, {needed.usable_gib:.1f} "
        f"usable with the plan's margin): {parts}. "
        + (f"It would fit with {advice}." if advice else "Nothing the stack can set makes it fit.")
    )


def parse(
    raw: Mapping[str, str | None],
    *,
    stack: str,
    project: str | None,
    region: str | None,
    zone: str | None,
    has_token: bool,
) -> StackConfig:
    """Turn raw config strings into a StackConfig, or raise ConfigError naming every bad value."""
    r = _Reader(raw)
    mode = _mode(r)
    local = mode == "local"
    tpu_slice = _tpu_slice(r)
    region = _place(r, mode, project, region, zone)
    if not has_token and not local:
        r.problem(f"{key('hfToken')}: not set; run: pulumi config set --secret hfToken hf_...")
    kind, reservation = _capacity(r, mode)
    scale_to_zero = _scale_to_zero(r, reservation) and not local
    slice_ready_timeout = r.positive("sliceReadyTimeoutMinutes")
    version = _cluster_version(r, mode, tpu_slice)
    names = _names(r)
    bucket = _bucket(r, stack, project, local)
    job = _job(r, local)
    num_slices = _num_slices(r, tpu_slice, mode, job)
    _flex_start(r, kind, scale_to_zero, version, job.timeout_minutes, slice_ready_timeout)
    _spot_grace(r, kind, mode, version)
    run_minutes = flex_start_run_minutes(job.timeout_minutes, slice_ready_timeout)
    price = _price(r)
    if tpu_slice is not None and mode in GKE_MODES and not r.problems:
        _memory(r, tpu_slice, job)
    switches = {"deletion_protection": r.boolean("deletionProtection"),
                "bucket_force_destroy": r.boolean("bucketForceDestroy"),
                "defer_and_fuse": r.boolean("deferAndFuse"), "compile_cache": r.boolean("compileCache")}  # fmt: skip
    if r.problems:
        raise ConfigError(r.problems)
    return StackConfig(
        stack=stack,
        project=project,
        region=region,
        zone=zone if mode == "standard" else None,
        mode=mode,
        slice=tpu_slice,
        num_slices=num_slices,
        capacity=SliceCapacity(kind, reservation, scale_to_zero, run_minutes),
        price_per_chip_hour=price,
        slice_ready_timeout_minutes=slice_ready_timeout,
        cluster_version=version,
        bucket_name=bucket,
        job=job,
        ray_address=r.value("rayAddress"),
        head_cpus=r.positive("headCpus", minimum=0),
        **names,
        **switches,
    )


def _names(r: _Reader) -> dict[str, str]:
    return {
        "cluster_name": r.name("clusterName", _DNS_1035, 40, "a GKE cluster name (lowercase letters, digits, '-')"),
        "ray_cluster_name": r.name(
            "rayClusterName", _DNS_1035, 53, "a DNS-1035 label (the TPU webhook builds hostnames from it)"
        ),
        "namespace": r.name("namespace", _DNS_1123, 63, "a DNS-1123 label"),
        "service_account": r.name("serviceAccount", _DNS_1123, 63, "a DNS-1123 label"),
        "repository": r.name("repositoryName", _DNS_1035, 63, "an Artifact Registry repository id"),
        "image_name": r.name("imageName", _DNS_1123, 128, "an image name"),
        "head_machine_type": r.name("headMachineType", _MACHINE_TYPE, 63, "a GCE machine type such as n2-standard-8"),
    }


def load() -> tuple[StackConfig, object]:
    """Read the running stack's config; returns it and the token as a Pulumi secret Output."""
    import pulumi

    cfg, gcp = pulumi.Config(PROJECT), pulumi.Config("gcp")
    raw = {name: cfg.get(name) for name in declared_keys() if name not in secret_keys()}
    token = cfg.get_secret("hfToken")
    stack_config = parse(
        raw,
        stack=pulumi.get_stack(),
        project=gcp.get("project"),
        region=gcp.get("region"),
        zone=gcp.get("zone"),
        has_token=token is not None,
    )
    return stack_config, token
