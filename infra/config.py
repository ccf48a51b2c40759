"""The stack's settings: read once, validated once, frozen, before any resource exists.

Keys, types and defaults live in Pulumi.yaml's `config:` block (so `pulumi config`
documents them); this module reads that block instead of repeating it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import yaml

from infra import PROJECT, PULUMI_YAML
from infra.tpu import GENERATIONS, TpuSlice, is_topology

ROOT = PULUMI_YAML.parent
MODES = ("standard", "autopilot", "local")
GKE_MODES = ("standard", "autopilot")

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][-a-z0-9_.]{1,61}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_ZONE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+)-gke\.(\d+))?$")
_RESERVATION = re.compile(
    r"^(?:projects/([a-z][-a-z0-9]{4,28}[a-z0-9])/reservations/)?([a-z]([-a-z0-9]{0,61}[a-z0-9])?)$"
)


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
    learning_rate: float
    timeout_minutes: int
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
    slice: TpuSlice
    spot: bool
    reservation: str
    cluster_name: str
    cluster_version: str
    head_machine_type: str
    deletion_protection: bool
    bucket_name: str
    bucket_force_destroy: bool
    repository: str
    image_name: str
    ray_cluster_name: str
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
    def location(self) -> str:
        """Where the cluster lives: a region for Autopilot, a zone for Standard."""
        return self.region if self.autopilot else self.zone  # type: ignore[return-value]

    @property
    def reservation_project(self) -> str | None:
        return _RESERVATION.match(self.reservation).group(1) if self.reservation else None

    @property
    def reservation_name(self) -> str | None:
        return _RESERVATION.match(self.reservation).group(2) if self.reservation else None


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
    m = _VERSION.match(text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def version_at_least(version: str, minimum: str) -> bool:
    """MAJOR.MINOR means GKE's current patch of that minor, so only the minor is compared."""
    have, need = parse_version(version), parse_version(minimum)
    return have[:2] >= need[:2] if len(have) == 2 else have >= need


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
    problems: list[str] = []
    decl = declared_keys()

    def value(name: str) -> str:
        v = raw.get(name)
        if v is None:
            default = decl[name].get("default")
            return "" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        return str(v)

    def typed(name: str, cast: Callable[[str], object]):
        text = value(name)
        try:
            return cast(text)
        except ValueError:
            problems.append(f"{key(name)}: {text!r} is not {decl[name]['type']}")
            return None

    def boolean(text: str) -> bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"

    def positive(name: str) -> int:
        n = typed(name, int)
        if n is not None and n <= 0:
            problems.append(f"{key(name)}: {n} must be a positive integer")
        return n or 0

    def name_check(name: str, pattern: re.Pattern, limit: int, what: str) -> str:
        text = value(name)
        if len(text) > limit or not pattern.match(text):
            problems.append(f"{key(name)}: {text!r} must be {what} of at most {limit} characters")
        return text

    mode = value("mode")
    if mode not in MODES:
        problems.append(f"{key('mode')}: {mode!r} is not a mode; allowed: {', '.join(MODES)}")

    gen_name, topology = value("tpuGeneration"), value("tpuTopology")
    generation = GENERATIONS.get(gen_name)
    tpu_slice = None
    if generation is None:
        problems.append(
            f"{key('tpuGeneration')}: {gen_name!r} is not a known TPU generation; allowed: {', '.join(GENERATIONS)}"
        )
    elif topology not in generation.topologies:
        why = "is not a topology" if not is_topology(topology) else f"is not a {gen_name} multi-host topology"
        problems.append(
            f"{key('tpuTopology')}: {topology!r} {why}; allowed for {gen_name}: {', '.join(generation.topologies)}"
        )
    else:
        tpu_slice = TpuSlice(generation, topology)

    local = mode == "local"
    if not project and not local:
        problems.append("gcp:project: not set; run: pulumi config set gcp:project PROJECT_ID")
    if region and not _REGION.match(region):
        problems.append(f"gcp:region: {region!r} is not a region name such as us-east5")
        region = None
    zone_match = _ZONE.match(zone) if zone else None
    if zone and not zone_match:
        problems.append(f"gcp:zone: {zone!r} is not a zone name such as us-east5-b")
    if mode == "standard":
        if not zone:
            problems.append("gcp:zone: not set; standard mode makes a zonal cluster: pulumi config set gcp:zone ZONE")
        elif zone_match:
            if region and zone_match.group(1) != region:
                problems.append(f"gcp:zone: {zone!r} is not in gcp:region {region!r}")
            region = region or zone_match.group(1)
    elif mode == "autopilot" and not region:
        problems.append(
            "gcp:region: not set; autopilot mode makes a regional cluster: pulumi config set gcp:region REGION"
        )

    if not has_token and not local:
        problems.append(f"{key('hfToken')}: not set; run: pulumi config set --secret hfToken hf_...")

    spot = typed("spot", boolean)
    reservation = value("reservation")
    if reservation and not _RESERVATION.match(reservation):
        problems.append(f"{key('reservation')}: {reservation!r} must be NAME or projects/PROJECT/reservations/NAME")
    if local and (spot or reservation):
        problems.append(f"{key('mode')}: 'local' runs no TPU; unset {key('spot')} and {key('reservation')} for it")
    elif spot and reservation:
        problems.append(
            f"{key('spot')}: true cannot be combined with {key('reservation')} {reservation!r}: Spot VMs do not consume reservations; unset one"
        )

    version = value("clusterVersion")
    if parse_version(version) is None:
        problems.append(
            f"{key('clusterVersion')}: {version!r} is not a GKE version; use MAJOR.MINOR (1.36) or 1.36.X-gke.N"
        )
    elif generation is not None and mode in GKE_MODES:
        minimum = generation.min_gke_autopilot if mode == "autopilot" else generation.min_gke_standard
        if not version_at_least(version, minimum):
            problems.append(
                f"{key('clusterVersion')}: {version!r} is too old for {gen_name} on {mode} GKE with the Ray add-on; need {minimum} or newer"
            )

    cluster_name = name_check("clusterName", _DNS_1035, 40, "a GKE cluster name (lowercase letters, digits, '-')")
    ray_cluster_name = name_check(
        "rayClusterName", _DNS_1035, 53, "a DNS-1035 label (the TPU webhook builds hostnames from it)"
    )
    namespace = name_check("namespace", _DNS_1123, 63, "a DNS-1123 label")
    service_account = name_check("serviceAccount", _DNS_1123, 63, "a DNS-1123 label")
    repository = name_check("repositoryName", _DNS_1035, 63, "an Artifact Registry repository id")
    image_name = name_check("imageName", _DNS_1123, 128, "an image name")

    bucket = value("bucketName") or (f"{project}-{stack}-checkpoints" if project and not local else "")
    if bucket and (not _BUCKET.match(bucket) or ".." in bucket or bucket.startswith("goog") or "google" in bucket):
        problems.append(
            f"{key('bucketName')}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 - _ ., "
            "starting and ending with a letter or digit, no 'goog' prefix or 'google')"
        )

    learning_rate = typed("learningRate", float)
    if learning_rate is not None and learning_rate <= 0:
        problems.append(f"{key('learningRate')}: {value('learningRate')!r} must be a positive number")
    job = JobSettings(
        model=value("model"),
        dataset=value("dataset"),
        dataset_split=value("datasetSplit"),
        epochs=positive("epochs"),
        batch_size=positive("batchSize"),
        seq_len=positive("seqLen"),
        learning_rate=learning_rate or 0.0,
        timeout_minutes=positive("jobTimeoutMinutes"),
        collectives_workers=positive("collectivesWorkers"),
        finetune_workers=positive("finetuneWorkers"),
        local_storage_path=str(ROOT / value("localStoragePath")),
    )
    if local:
        # The local stack names files of this checkout; the jobs run elsewhere, so make them absolute.
        job = replace(job, model=_local_path(job.model), dataset=_local_path(job.dataset))
    for name in ("model", "dataset", "datasetSplit"):
        if not value(name):
            problems.append(f"{key(name)}: must not be empty")

    deletion_protection = typed("deletionProtection", boolean)
    force_destroy = typed("bucketForceDestroy", boolean)
    if problems:
        raise ConfigError(problems)
    return StackConfig(
        stack=stack,
        project=project,
        region=region,
        zone=zone if mode == "standard" else None,
        mode=mode,
        slice=tpu_slice,
        spot=bool(spot),
        reservation=reservation,
        cluster_name=cluster_name,
        cluster_version=version,
        head_machine_type=value("headMachineType"),
        deletion_protection=bool(deletion_protection),
        bucket_name=bucket,
        bucket_force_destroy=bool(force_destroy),
        repository=repository,
        image_name=image_name,
        ray_cluster_name=ray_cluster_name,
        namespace=namespace,
        service_account=service_account,
        job=job,
        ray_address=value("rayAddress"),
    )


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
