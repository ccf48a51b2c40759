"""The last resource of the stack: runs the collectives check and the fine-tune, exports the checkpoint.

A Pulumi dynamic resource over infra/runner/ray_jobs.py (which uses infra/runner/job_client.py and
infra/runner/slice_scaler.py). Its inputs hold no secret: Google and Ray credentials are read where
it runs, when it runs.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import asdict

import pulumi
import pulumi.dynamic as dynamic

from infra.config.stack import StackConfig
from infra.resources.raycluster import DASHBOARD_PORT, head_service
from infra.runner import ray_jobs
from infra.runner.resilience import RetryPolicy

OUTPUT_KEYS = (
    "checkpoint", "checkpoints", "metrics", "history", "loss_curve", "samples", "data_report", "collectives", "job_ids",
    "slice_hours", "run_hours", "evaluation", "reward_curve",
)  # fmt: skip
# How to reach the head, how long to wait and how often to restart: changing them does not
# re-run anything (max_failures reaches the next job submitted).
REACH_KEYS = ("target", "timeout_s", "poll_s", "retry_budget_s", "slice", "max_failures", "price", "identity")
# How long a call to the head may keep failing (connection errors, 5xx) before `up` gives up.
RETRY_BUDGET_S = RetryPolicy.budget_s


def training_settings(cfg: StackConfig) -> dict:
    """What the fine-tune is asked to do (its settings, as the job declares them: jobs/config/settings.py), without
    max_failures, which does not define the run (changing it re-runs nothing and reaches the next submission),
    nor the unset ones (None: Pulumi keeps no input of it)."""
    return {k: v for k, v in asdict(cfg.job).items() if k != "max_failures" and v is not None}


def gke_target(
    namespace: str, ray_cluster_name: str, endpoint: pulumi.Input[str], ca_certificate: pulumi.Input[str]
) -> dict:
    """How the job resource reaches the Ray head on GKE: the API server's service proxy to its dashboard."""
    return {
        "kind": "gke",
        "endpoint": endpoint,
        "ca_certificate": ca_certificate,
        "namespace": namespace,
        "service": head_service(ray_cluster_name),
        "port": DASHBOARD_PORT,
    }


def diff_props(olds: dict, news: dict) -> dynamic.DiffResult:
    """Replace when what defines the run changed; else nothing to do.

    In preview an input not known yet arrives as Pulumi's UNKNOWN marker, which never equals
    the recorded value, so the plan shows the replacement that may come.
    """
    replaces = [k for k in ray_jobs.DEFINING_KEYS if olds.get(k) != news.get(k)]
    others = [k for k in REACH_KEYS if olds.get(k) != news.get(k)]
    return dynamic.DiffResult(
        changes=bool(replaces or others), replaces=replaces, stables=[], delete_before_replace=bool(replaces)
    )


def identity(cfg: StackConfig, principal: pulumi.Input[str]) -> dict:
    """Who the pods are to the bucket, for the job resource's message when their storage check fails."""
    return {"namespace": cfg.namespace, "service_account": cfg.service_account, "bucket": cfg.bucket_name,
            "principal": principal}  # fmt: skip


def training_props(cfg: StackConfig, target: dict, cluster: pulumi.Input[str], image: pulumi.Input[str],
                   identity: dict | None = None) -> dict:  # fmt: skip
    """The resource's inputs; `make local` builds the same and calls the provider with them."""
    return {
        "stack": cfg.stack,
        "cluster": cluster,
        "image": image,
        "code": ray_jobs.jobs_code_hash(),
        "settings": training_settings(cfg),
        "collectives_workers": cfg.collectives_workers if cfg.local else None,
        "target": target,
        "timeout_s": cfg.job_timeout_minutes * 60,
        "max_failures": cfg.job.max_failures,
        "poll_s": 2 if cfg.local else 15,
        "retry_budget_s": RETRY_BUDGET_S,
        "slice": slice_settings(cfg),
        "price": price_settings(cfg),
        "identity": identity,
    }


def price_settings(cfg: StackConfig) -> dict | None:
    """What the job resource needs to print the run's cost: the slice's price, when there is one."""
    from infra.prices import price_of

    price = None if cfg.local or not cfg.capacity.scale_to_zero else price_of(cfg)
    if price is None:
        return None
    return {"usd_per_chip_hour": price.usd_per_chip_hour, "chips_per_host": cfg.slice.generation.chips_per_host,
            "chips": cfg.chips}  # fmt: skip


def slice_settings(cfg: StackConfig) -> dict | None:
    """What the job resource scales around the jobs: the TPU worker group, a replica a slice (scaleToZero only)."""
    if not cfg.capacity.scale_to_zero:
        return None
    return {
        "ray_cluster": cfg.ray_cluster_name,
        "group": cfg.slice.worker_group,
        "replicas": cfg.num_slices,
        "hosts": cfg.hosts,  # of every slice
        "ready_timeout_s": cfg.slice_ready_timeout_minutes * 60,
        "capacity": cfg.capacity.kind,
    }


def local_target(address: str) -> dict:
    return {"kind": "local", "address": address}


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM, like Ctrl-C, ends the wait with a word on what keeps running (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _TrainingJobsProvider(dynamic.ResourceProvider):
    # Pulumi pickles this class by reference: its host imports `infra` from the project directory.

    def create(self, props: dict) -> dynamic.CreateResult:
        with sigterm_as_interrupt():
            outputs = ray_jobs.run_pipeline(props)
        return dynamic.CreateResult(id_=outputs["job_ids"]["finetune"], outs={**props, **outputs})

    def diff(self, _id, olds, news):
        return diff_props(olds, news)

    def update(self, _id, olds, news):
        # Only how to reach the head or how long to wait changed: the run and its outputs stand.
        return dynamic.UpdateResult(outs={**olds, **{k: news.get(k) for k in REACH_KEYS}})

    def delete(self, _id, props):
        ray_jobs.stop_active(props, props.get("job_ids", {}))
        ray_jobs.release_slice(props)


class TrainingJobs(dynamic.Resource):
    """Outputs: checkpoint, checkpoints, metrics, history, loss_curve, samples, data_report, collectives, job_ids,
    slice_hours, run_hours, evaluation, reward_curve."""

    checkpoint: pulumi.Output[str]
    checkpoints: pulumi.Output[list]
    metrics: pulumi.Output[dict]
    history: pulumi.Output[list]
    loss_curve: pulumi.Output[str]
    samples: pulumi.Output[str]
    data_report: pulumi.Output[dict]
    slice_hours: pulumi.Output[float]
    run_hours: pulumi.Output[float]
    collectives: pulumi.Output[dict]
    job_ids: pulumi.Output[dict]
    evaluation: pulumi.Output[dict]  # the before/after evaluation (jobs/evaluation/before_after.py), None without one
    reward_curve: pulumi.Output[str]  # a GRPO run's reward.png (None for the other objectives)

    def __init__(self, name: str, props: dict, opts: pulumi.ResourceOptions | None = None):
        """`props`: training_props(...), what the jobs are asked to do and where."""
        # Outputs are declared as inputs of None so that Pulumi exposes them as attributes.
        props = props | dict.fromkeys(OUTPUT_KEYS)
        timeout = pulumi.CustomTimeouts(create=f"{props['timeout_s'] * 2 // 60 + 10}m")
        opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(custom_timeouts=timeout))
        super().__init__(_TrainingJobsProvider(), name, props, opts)
