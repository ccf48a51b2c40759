"""The stack's own checks, one per concern (the mode and the place, the TPU slice and its count, the capacity,
versions, names, the bucket, the data file, what the memory plan says); each adds what it finds wrong to the
reader's problems, so every problem is reported together. The job's settings are checked by the job's own
rules (infra/config/job.py).
"""

from __future__ import annotations

import difflib
import math
import re
import urllib.parse
from pathlib import Path

from infra import ROOT
from infra.cloud.capacity import (
    CAPACITIES,
    FLEX_START_MAX_RUN_MINUTES,
    FLEX_START_MIN_GKE,
    RESERVATION,
    SPOT_GRACE_MIN_GKE,
    flex_start_run_minutes,
)
from infra.cloud.tpu import GENERATIONS, TpuSlice, is_topology
from infra.config.reader import Reader, key, parse_version, version_at_least
from infra.job_modules import data_formats, modality

MODES = ("standard", "autopilot", "local")
GKE_MODES = ("standard", "autopilot")

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][-a-z0-9_.]{1,61}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_ZONE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
# GCE machine types: family-kind-size words (n2-standard-8, c3-highmem-4-lssd, n1-custom-4-8192).
_MACHINE_TYPE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+){1,4}$")
# A hub id (org/name, as the Hugging Face hub spells them) or a path: no whitespace, control
# characters or shell syntax, which no repository or file the jobs load can contain.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_PATH = re.compile(r"^(~|\.{1,2})?/?[A-Za-z0-9._+@=,-]+(/[A-Za-z0-9._+@=,-]+)*/?$")
# Data may also be gs:// objects, and files or objects named by a glob.
_DATA_PATH = re.compile(r"^((~|\.{1,2})?/?|gs://)[A-Za-z0-9._+@=,*?-]+(/[A-Za-z0-9._+@=,*?\[\]-]+)*/?$")

# GKE's nodes per cluster before a quota lift ("Nodes per cluster", cloud.google.com/kubernetes-engine/quotas,
# read 2026-12); one of them is the head's node.
MAX_CLUSTER_NODES = 5000


def is_model_ref(text: str) -> bool:
    """A hub id (`org/name`), a path, or a gs:// directory (an earlier run's export); whitespace, control
    characters and shell syntax never are."""
    return bool(_HUB_ID.fullmatch(text) or _PATH.fullmatch(text) or _PATH.fullmatch(text.removeprefix("gs:/")))


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


def known_keys(r: Reader) -> None:
    """Every key set in the project's namespace is one Pulumi.yaml declares: the CLI passes any other on (a
    misspelt `lerningRate` would leave the run at the default rate, silently)."""
    for name in sorted(set(r.raw) - set(r.decl)):
        closest = difflib.get_close_matches(name, r.decl, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(closest)}? " if closest else ""
        r.problem(f"{key(name)}: not a key this project reads; {hint}(pulumi config rm {name}; `pulumi config` "
                  "and Pulumi.yaml list the keys)")  # fmt: skip


def mode(r: Reader) -> str:
    mode = r.value("mode")
    if mode not in MODES:
        r.problem(f"{key('mode')}: {mode!r} is not a mode; allowed: {', '.join(MODES)}")
    return mode


def tpu_slice(r: Reader) -> TpuSlice | None:
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


def num_slices(r: Reader, n: int, tpu_slice: TpuSlice | None, mode: str, collectives_workers: int) -> None:
    """Slices of the topology: as many as a cluster's nodes hold; in local mode, groups of the CPU workers (the
    fine-tune's own check covers its workers: setting_checks.placement_problems)."""
    if n > 1 and mode == "local":
        if collectives_workers % n:
            r.problem(f"{key('numSlices')}: {n} does not divide {key('collectivesWorkers')} {collectives_workers}: "
                      "local mode stands in for each slice with an equal group of CPU workers; set collectivesWorkers "
                      f"to a multiple of {n}")  # fmt: skip
    elif n > 1 and tpu_slice is not None:
        most = (MAX_CLUSTER_NODES - 1) // tpu_slice.hosts
        if n > most:
            r.problem(f"{key('numSlices')}: {n} slices of {tpu_slice.generation.name} {tpu_slice.topology} are "
                      f"{n * tpu_slice.hosts} TPU hosts, past GKE's {MAX_CLUSTER_NODES} nodes a cluster (one is the "
                      f"head's): at most {most}, or a larger tpuTopology")  # fmt: skip


def place(r: Reader, mode: str, project: str | None, region: str | None, zone: str | None) -> str | None:
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


def capacity(r: Reader, mode: str) -> tuple[str, str]:
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


def flex_start(
    r: Reader, capacity: str, scale_to_zero: bool, version: str, job_timeout: int, ready_timeout: int
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


def spot_grace(r: Reader, capacity: str, mode: str, version: str) -> None:
    """A Standard Spot pool raises its kubelet's shutdown grace (infra/cloud/capacity.py), which GKE allows from a
    given control-plane version: older, a preempted pod would get 15 s, too few to save a step."""
    if capacity == "spot" and mode == "standard" and parse_version(version) is not None:
        if not version_at_least(version, SPOT_GRACE_MIN_GKE):
            r.problem(f"{key('clusterVersion')}: {version!r} cannot give Spot pods more than 15 s to save before a "
                      f"preemption; need {SPOT_GRACE_MIN_GKE} or newer (GKE's Spot shutdown grace), or another "
                      f"{key('capacity')}")  # fmt: skip


def price(r: Reader) -> float | None:
    text = r.value("pricePerChipHour")
    if not text:
        return None
    price = r.typed("pricePerChipHour", float)
    if price is not None and not (math.isfinite(price) and 0 <= price < 1000):
        r.problem(f"{key('pricePerChipHour')}: {text!r} must be a price in USD per chip-hour, such as 2.70")
        return None
    return price


def scale_to_zero(r: Reader, reservation: str) -> bool:
    """Default true, but false with a reservation: reserved capacity is paid whether nodes exist or not,
    so scaling to zero would save nothing and cost a provisioning wait per run."""
    if r.given("scaleToZero") is None:
        return not reservation
    return r.boolean("scaleToZero")


def cluster_version(r: Reader, mode: str, tpu_slice: TpuSlice | None) -> str:
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


def bucket(r: Reader, stack: str, project: str | None, local: bool) -> str:
    bucket = r.value("bucketName") or (f"{project}-{stack}-checkpoints" if project and not local else "")
    if bucket and (not _BUCKET.fullmatch(bucket) or ".." in bucket or bucket.startswith("goog") or "google" in bucket):
        r.problem(
            f"{key('bucketName')}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 - _ ., "
            "starting and ending with a letter or digit, no 'goog' prefix or 'google')"
        )
    return bucket


def dataset_file(r: Reader) -> str:
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
    if path.suffix not in data_formats.LOCAL_DATA:
        r.problem(f"{key('datasetFile')}: {text!r} must be a {', '.join(data_formats.LOCAL_DATA)} file")
    elif not path.is_file() or path.stat().st_size == 0:
        r.problem(f"{key('datasetFile')}: {text!r} is not a file with records (looked at {path})")
    else:
        return str(path)
    return ""


def grpo_prompts(r: Reader, dataset_file: str, job) -> None:
    """objective grpo on a datasetFile without a prompt column (after datasetColumns' renames) is refused at preview,
    as the job refuses it before Ray (jobs/data/prompt_data.py prompts_of), naming the file's columns and the fix."""
    if job.objective != "grpo" or not dataset_file:
        return
    try:
        renames, columns = job.column_renames, data_formats.first_columns(dataset_file)
    except (OSError, ValueError):  # datasetColumns' own problem (named by its check), or a file the job will name
        return
    if columns is None or "prompt" in [renames.get(c, c) for c in columns]:
        return
    r.problem(f"{key('datasetFile')}: {Path(dataset_file).name} has no prompt column for {key('objective')} grpo "
              f"(its columns: {', '.join(columns) or 'none'}): rename the one that holds the prompts, e.g. pulumi "
              f"config set {key('datasetColumns')} prompt=question, or give records with a prompt (text or turns)")  # fmt: skip


def memory(r: Reader, tpu_slice: TpuSlice, job) -> None:
    """A Gemma 4 size the table knows must fit the slice's device memory, or the preview names what would."""
    from infra.cloud.models import memory_plan, memory_remedy

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


def towers(r: Reader, job) -> None:
    """A modality that needs a tower the model's size lacks (a size the table knows) is refused at preview."""
    from infra.cloud.models import TOWERS, known_model, missing_towers

    size = known_model(job.model)
    unbuilt = modality.UNBUILT.get(TOWERS[size.name].model_type) if size is not None else None
    if unbuilt and modality.towers_of(job.modality):
        r.problem(f"{key('modality')}: {job.modality} on {job.model}: {unbuilt}")
    elif missing := missing_towers(job):
        having = [name for name, t in TOWERS.items()
                  if all(getattr(t, k) for k in missing) and t.model_type not in modality.UNBUILT]  # fmt: skip
        r.problem(f"{key('modality')}: {job.modality} needs Gemma 4's {' and '.join(missing)} tower, which "
                  f"{job.model} ({size.name}) does not have: use a size that has it ({', '.join(having)}: "
                  f"google/gemma-4-{having[0]}-it), or a modality without it")  # fmt: skip


def names(r: Reader) -> dict[str, str]:
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


def model_and_data_refs(r: Reader, job) -> None:
    """What the pods will load: a hub id or a path (gs:// too for data), without whitespace, control characters or
    shell syntax, which no repository or file the jobs load can contain."""
    for name, text, valid, what in (("model", job.model, is_model_ref, "a path or gs:// directory"),
                                    ("dataset", job.dataset, is_data_ref, "a path, glob or gs:// URI")):  # fmt: skip
        if not valid(text):
            r.problem(f"{key(name)}: {text!r} must be a hub id (org/name) or {what}, without whitespace, "
                      "control characters or shell syntax")  # fmt: skip


def ray_address(r: Reader) -> str:
    address = r.value("rayAddress")
    if not is_http_url(address):
        r.problem(f"{key('rayAddress')}: {address!r} must be a Ray dashboard URL such as http://127.0.0.1:8265")
    return address
