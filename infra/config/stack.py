"""The stack's settings: read once, validated once, frozen, before any resource exists.

Keys, types and defaults live in Pulumi.yaml's `config:` block (so `pulumi config` documents them; the
fine-tune's keys there are written from the job's own declarations, jobs/config/settings.py). `parse` reads the raw
strings (infra/config/reader.py), runs the stack's checks (infra/config/checks.py) and the job's (through
infra/config/job.py), and builds one StackConfig; every problem found is reported together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from infra import PROJECT, ROOT
from infra.cloud.capacity import SliceCapacity, flex_start_run_minutes
from infra.cloud.tpu import TpuSlice
from infra.config import checks, cpu_node, serving_checks
from infra.config.job import job_settings
from infra.config.reader import ConfigError, Reader, declared_keys, key, secret_keys
from infra.job_modules import settings
from infra.serving.app import ServeConfig

__all__ = ["ConfigError", "StackConfig", "key", "load", "parse"]

COMPILE_CACHE_PREFIX = "torch_tpu_compile_cache"


@dataclass(frozen=True)
class StackConfig:
    stack: str
    project: str | None  # None in local mode only
    region: str | None
    zone: str | None
    mode: str
    slice: TpuSlice  # one slice; there are num_slices of it (job.num_slices)
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
    job: settings.FinetuneSettings  # what the fine-tune is sent (its run name is the job resource's)
    job_timeout_minutes: int
    dataset_file: str  # a local file the stack uploads to its bucket ("" for none)
    collectives_workers: int  # local mode: the collectives check's CPU workers
    ray_address: str  # local mode only
    serve: ServeConfig | None = None  # what the endpoint serves, on which host (None: serve off)

    @property
    def serve_name(self) -> str:
        """The serving RayService: KubeRay names its Service `<this>-serve-svc`."""
        return serving_checks.serve_name(self.ray_cluster_name)

    @property
    def local(self) -> bool:
        return self.mode == "local"

    @property
    def autopilot(self) -> bool:
        return self.mode == "autopilot"

    @property
    def num_slices(self) -> int:
        return self.job.num_slices

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
    r = Reader(raw)
    checks.known_keys(r)
    mode = checks.mode(r)
    local = mode == "local"
    tpu_slice = checks.tpu_slice(r)
    region = checks.place(r, mode, project, region, zone)
    if not has_token and not local:
        r.problem(f"{key('hfToken')}: not set; run: pulumi config set --secret hfToken hf_...")
    kind, reservation = checks.capacity(r, mode)
    scale_to_zero = checks.scale_to_zero(r, reservation) and not local
    slice_ready_timeout = r.positive("sliceReadyTimeoutMinutes")
    version = checks.cluster_version(r, mode, tpu_slice)
    names = checks.names(r)
    bucket = checks.bucket(r, stack, project, local)
    dataset_file = checks.dataset_file(r)
    job_timeout, collectives_workers = r.positive("jobTimeoutMinutes"), r.positive("collectivesWorkers")
    job = job_settings(r, local=local, tpu_slice=tpu_slice, bucket=bucket, dataset_file=dataset_file,
                       local_storage=str(ROOT / r.value("localStoragePath")), workers=r.positive("finetuneWorkers"))  # fmt: skip
    checks.model_and_data_refs(r, job)
    checks.towers(r, job)
    checks.grpo_prompts(r, dataset_file, job)
    checks.num_slices(r, job.num_slices, tpu_slice, mode, collectives_workers)
    checks.flex_start(r, kind, scale_to_zero, version, job_timeout, slice_ready_timeout)
    checks.spot_grace(r, kind, mode, version)
    serve = serving_checks.serving(r, mode, tpu_slice, job)
    if serve is not None and not local:
        serving_checks.serve_name_length(r, names["ray_cluster_name"])
    if mode == "standard":
        cpu_node.check_room(r, names["head_machine_type"], serve)
    price = checks.price(r)
    address = checks.ray_address(r) if local else r.value("rayAddress")
    if tpu_slice is not None and mode in checks.GKE_MODES and not r.problems:
        checks.memory(r, tpu_slice, job)
    switches = {"deletion_protection": r.boolean("deletionProtection"),
                "bucket_force_destroy": r.boolean("bucketForceDestroy"),
                "defer_and_fuse": r.boolean("deferAndFuse"), "compile_cache": r.boolean("compileCache")}  # fmt: skip
    if r.problems:
        raise ConfigError(r.problems)
    capacity = SliceCapacity(kind, reservation, scale_to_zero, flex_start_run_minutes(job_timeout, slice_ready_timeout))
    return StackConfig(stack=stack, project=project, region=region, zone=zone if mode == "standard" else None,
                       mode=mode, slice=tpu_slice, capacity=capacity, price_per_chip_hour=price,
                       slice_ready_timeout_minutes=slice_ready_timeout, cluster_version=version, bucket_name=bucket,
                       job=job, job_timeout_minutes=job_timeout, dataset_file=dataset_file,
                       collectives_workers=collectives_workers, ray_address=address,
                       head_cpus=r.positive("headCpus", minimum=0), serve=serve, **names, **switches)  # fmt: skip


def project_keys() -> set[str]:
    """Every key set in the project's namespace, declared or not: the Pulumi CLI's language host hands the
    program its config as PULUMI_CONFIG (JSON), and set_mocks' tests through set_all_config."""
    from pulumi.runtime import config

    given = config.get_config_env() | config.CONFIG.get()
    return {k.split(":", 1)[1] for k in given if k.startswith(f"{PROJECT}:")}


def load() -> tuple[StackConfig, object]:
    """Read the running stack's config; returns it and the token as a Pulumi secret Output."""
    import pulumi

    cfg, gcp = pulumi.Config(PROJECT), pulumi.Config("gcp")
    names = set(declared_keys()) | project_keys()
    raw = {name: cfg.get(name) for name in names if name not in secret_keys()}
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
