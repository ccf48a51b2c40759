"""Runs the two jobs of `jobs/` on a Ray head, once each, and returns what they produced.

No Pulumi here: the dynamic resource (infra/training.py), `make local` and the tests call
these functions directly. A job's submission id is a hash of what defines it, so a second
`up` attaches to the job the first one started instead of starting another. With scaleToZero
the TPU slice is scaled up before the jobs and back to 0 after them (infra/runner/slice_scaler.py).
"""

from __future__ import annotations

import hashlib
import json
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra import JOBS_DIR
from infra.job_modules import command_line, outcome, storage
from infra.job_modules import settings as job_settings
from infra.runner.job_client import Log, LogFollower, SubmitUncertain, connect, default_log
from infra.runner.kube_api import KubeApi, api_server_url
from infra.runner.resilience import GoogleTokens, RetryPolicy, TokenSource, Unreachable
from infra.runner.slice_scaler import NoRayCluster, SliceScaler

UPLOAD_EXCLUDES = ["__pycache__", "*.pyc", "tiny_assets.py"]
ACTIVE, DONE, BROKEN = {"PENDING", "RUNNING"}, "SUCCEEDED", {"FAILED", "STOPPED"}
RESULT_PREFIX = outcome.RESULT_PREFIX
LOG_TAIL_LINES = 50
MAX_ATTEMPTS = 20


class JobFailed(RuntimeError):
    """A job ended without success; the message carries its id, status and last log lines."""


def jobs_code_hash(jobs_dir: Path = JOBS_DIR) -> str:
    """A hash of the uploaded code: editing a job re-runs it."""
    digest = hashlib.sha256()
    for path in sorted(p for p in jobs_dir.rglob("*.py") if "__pycache__" not in p.parts):
        if path.name in UPLOAD_EXCLUDES:
            continue
        digest.update(path.relative_to(jobs_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class JobSpec:
    name: str
    script: str
    args: tuple[str, ...]

    @property
    def entrypoint(self) -> str:
        return shlex.join(["python", self.script, *self.args])


def job_specs(settings: dict, max_failures: int, collectives_workers: int | None = None) -> list[JobSpec]:
    """The collectives check, then the fine-tune: its settings (jobs/config/settings.py) as its own command line, and
    their placement as the check's (with its own worker count off TPU)."""
    finetune = job_settings.from_dict(settings | {"max_failures": max_failures})
    return [
        JobSpec(
            "collectives", "ray_core_collectives.py", tuple(command_line.placement_argv(finetune, collectives_workers))
        ),
        JobSpec("finetune", "ray_train_llm_finetune.py", tuple(command_line.to_argv(finetune))),
    ]


def preflight(finetune: JobSpec) -> JobSpec:
    """The fine-tune's own data check, on the head: every record read, checked and rendered, no worker."""
    return JobSpec("preflight", finetune.script, (*finetune.args, "--preflight"))


# What a run is: change any of these and the jobs run again. How to reach the head and how
# long to wait are not in it.
DEFINING_KEYS = ("stack", "cluster", "image", "code", "settings", "collectives_workers")


def base_id(props: dict, job: str) -> str:
    """Stable per stack, job and everything that defines the job; attempts add a suffix."""
    defining = {k: props.get(k) for k in DEFINING_KEYS} | {"job": job}
    digest = hashlib.sha256(json.dumps(defining, sort_keys=True).encode()).hexdigest()[:16]
    return f"{props['stack']}-{job}-{digest}"


# ---- one job --------------------------------------------------------------------------------------


def job_info(client, submission_id: str):
    """Ray's JobDetails for the id, or None when no such job exists."""
    try:
        return client.get_job_info(submission_id)
    except RuntimeError as err:
        if "404" in str(err) or "does not exist" in str(err):
            return None
        raise


def job_status(client, submission_id: str) -> str | None:
    info = job_info(client, submission_id)
    return str(info.status) if info else None


def parse_result(logs: str) -> dict | None:
    lines = [line for line in logs.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None


def tail(logs: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(logs.splitlines()[-lines:])


def find_or_submit(
    client,
    spec: JobSpec,
    job_base_id: str,
    runtime_env: dict,
    policy: RetryPolicy,
    log: Log,
    needs_slice: Callable[[], None] = lambda: None,
) -> str:
    """Attach to a live or finished attempt; submit a new attempt only after a failed or stopped one.

    `needs_slice` runs before a submit or an attach (not for a finished job): it brings the slice up.
    """
    for attempt in range(1, MAX_ATTEMPTS + 1):
        submission_id = f"{job_base_id}-a{attempt}"
        status = job_status(client, submission_id)
        if status is None or status in ACTIVE:
            needs_slice()
        if status is None:
            log(f"[{spec.name}] submitting {submission_id}: {spec.entrypoint}")
            submit_once(client, spec, submission_id, runtime_env, policy, log)
            return submission_id
        if status in ACTIVE:
            log(f"[{spec.name}] {submission_id} is already {status}; attaching to it")
            return submission_id
        if status == DONE:
            log(f"[{spec.name}] {submission_id} already SUCCEEDED; reusing its result")
            return submission_id
        log(f"[{spec.name}] {submission_id} ended {status}; trying a new attempt")
    raise JobFailed(f"[{spec.name}] {MAX_ATTEMPTS} attempts of {job_base_id} all failed; change an input or clear them")


def submit_once(client, spec: JobSpec, submission_id: str, runtime_env: dict, policy: RetryPolicy, log: Log) -> None:
    """Submit, never twice: after a submit lost in transit, look the id up before sending it again."""
    delays = policy.delays(random.Random())
    started = time.monotonic()
    while True:
        try:
            client.submit_job(entrypoint=spec.entrypoint, submission_id=submission_id, runtime_env=runtime_env)
            return
        except SubmitUncertain as err:
            if job_status(client, submission_id) is not None:
                log(f"[{spec.name}] the submit of {submission_id} did reach the head; attaching to it")
                return
            if time.monotonic() - started >= policy.budget_s:
                raise Unreachable(f"[{spec.name}] submitting {submission_id} kept failing: {err}") from None
            log(f"[{spec.name}] the submit of {submission_id} was lost in transit ({err}); sending it again")
            time.sleep(next(delays))
        except RuntimeError as err:
            if "already exists" not in str(err):
                raise
            log(f"[{spec.name}] {submission_id} was submitted meanwhile; attaching to it")
            return


def wait(client, spec: JobSpec, submission_id: str, timeout_s: float, poll_s: float, log: Log) -> dict:
    """Stream status changes and new log lines until the job ends; its parsed result on success."""
    deadline = time.monotonic() + timeout_s
    status = None
    follower = LogFollower(client, submission_id, f"[{spec.name}]", log)
    while True:
        info = job_info(client, submission_id)
        current = str(info.status) if info else None
        if current != status:
            log(f"[{spec.name}] {submission_id}: {current}")
            status = current
        ended = status == DONE or status in BROKEN
        logs = follower.poll(info.driver_node_id if info else None, final=ended)
        if status == DONE:
            result = parse_result(logs)
            if result is None:
                raise JobFailed(f"[{spec.name}] {submission_id} SUCCEEDED but printed no result line\n{tail(logs)}")
            return result
        if status in BROKEN:
            raise JobFailed(
                f"[{spec.name}] job {submission_id} ended {status}; last {LOG_TAIL_LINES} log lines:\n{tail(logs)}"
            )
        if time.monotonic() >= deadline:
            # Nobody would own it after this error: stop it. A later attempt resumes from its checkpoints.
            client.stop_job(submission_id)
            raise JobFailed(
                f"[{spec.name}] job {submission_id} was still {status} after {timeout_s:.0f}s and has been stopped; "
                f"raise jobTimeoutMinutes and run `pulumi up` again. Last log lines:\n{tail(logs)}"
            )
        time.sleep(poll_s)


# ---- the pipeline ---------------------------------------------------------------------------------


def retry_policy(props: dict) -> RetryPolicy:
    return RetryPolicy(budget_s=float(props.get("retry_budget_s", RetryPolicy.budget_s)))


def slice_scaler(props: dict, tokens: TokenSource | None, policy: RetryPolicy, log: Log) -> SliceScaler | None:
    """The scaler of the stack's TPU worker group, when it scales to zero (GKE only)."""
    target, tpu = props["target"], props.get("slice")
    if target["kind"] != "gke" or not tpu:
        return None
    api = KubeApi(
        api_server_url(target["endpoint"]),
        tokens or GoogleTokens(),
        target.get("ca_certificate"),
        policy,
        log,
    )
    return SliceScaler(
        api, target["namespace"], tpu["ray_cluster"], tpu["group"], int(tpu["hosts"]), tpu["ready_timeout_s"],
        poll_s=min(props["poll_s"], 10), log=log, flex_start=tpu.get("capacity") == "flexStart",
        replicas=int(tpu.get("replicas", 1)),
    )  # fmt: skip


def run_pipeline(
    props: dict, log: Log = default_log, tokens: TokenSource | None = None, policy: RetryPolicy | None = None
) -> dict:
    """Collectives check, and only if it passes the fine-tune; returns the resource's outputs.

    With a scaler, the fine-tune's data check runs first on the head (`--preflight`: every record
    read and rendered, no TPU), so a bad file costs no slice-hours; then the slice comes up before
    the first job that needs it and goes back to 0 once the jobs have ended, succeeded or not, and
    the run's cost is printed. Interrupted (Ctrl-C, SIGTERM) while waiting, it says which job keeps
    running and re-raises: nothing is stopped or scaled down, and the next `pulumi up` attaches to
    that job.
    """
    policy = policy or retry_policy(props)
    tokens = tokens or (GoogleTokens() if props["target"]["kind"] == "gke" else None)
    client = connect(props["target"], tokens, policy, log)
    scaler = slice_scaler(props, tokens, policy, log)
    specs = job_specs(props["settings"], props["max_failures"], props.get("collectives_workers"))
    if scaler:
        specs = [preflight(specs[-1]), *specs]
    results, ids, slice_hours, started = {}, {}, 0.0, time.monotonic()
    try:
        for spec in specs:
            needs_slice = scaler.up if scaler and spec.name != "preflight" else lambda: None
            results[spec.name], ids[spec.name] = run_job(client, props, spec, policy, needs_slice, log)
    finally:
        # Not after an interrupt or an unreachable API server: a job may still be running on the slice.
        leave_up = isinstance(sys.exc_info()[1], KeyboardInterrupt | Unreachable)
        if scaler and scaler.up_since is not None and not leave_up:
            slice_hours = scale_down(scaler, log)
        run_hours = (time.monotonic() - started) / 3600
        if props.get("price") and not leave_up:  # a failed run's slice-hours cost money too
            log(cost_line(props["price"], slice_hours, run_hours))
    finetune = results["finetune"]
    return {
        "checkpoint": finetune["checkpoint"],
        "checkpoints": finetune["checkpoints"],
        "metrics": finetune["metrics"],
        "history": finetune.get("history", []),
        "loss_curve": finetune.get("loss_curve"),
        "reward_curve": finetune.get("reward_curve"),  # (GRPO's reward.png; None otherwise)
        "samples": finetune.get("samples"),
        "data_report": finetune.get("data_report"),
        "evaluation": finetune.get("evaluation"),
        "collectives": results["collectives"],
        "job_ids": ids,
        "slice_hours": round(slice_hours, 4),
        "run_hours": round(run_hours, 4),
    }


def cost_line(price: dict, slice_hours: float, run_hours: float) -> str:
    """What the run's slice cost (its host-hours x chips x the price), and what an always-on slice would have."""
    rate, chips_per_host, chips = price["usd_per_chip_hour"], price["chips_per_host"], price["chips"]
    used = slice_hours * chips_per_host * rate
    return (
        f"cost: ${used:,.2f} for {slice_hours:.2f} slice host-hours at ${rate:.2f} per chip-hour "
        f"(the walkthrough's always-on slice: at least ${run_hours * chips * rate:,.2f} for the same {run_hours:.2f} h)"
    )


def scale_down(scaler: SliceScaler, log: Log) -> float:
    """Scale to 0 without hiding the error that ended the jobs, if any; returns the slice's host-hours."""
    try:
        return scaler.down()
    except Exception as err:  # noqa: BLE001  (the scale-down must not mask why the jobs ended)
        log(f"TPU slice: scaling down FAILED ({err}); scale it yourself: kubectl edit raycluster {scaler.ray_cluster}")
        return 0.0


def run_job(client, props: dict, spec: JobSpec, policy: RetryPolicy, needs_slice, log: Log) -> tuple[dict, str]:
    """Find, attach to or submit one job, and wait for its result; returns (result, submission id)."""
    job_base = base_id(props, spec.name)
    if spec.name in ("preflight", "finetune"):
        # One Ray Train run per definition: a new attempt resumes from its checkpoints. The preflight
        # writes its data report where that run will be.
        objective = props["settings"].get("objective", "sft")  # (sft- for every run before DPO: their names kept)
        spec = JobSpec(spec.name, spec.script, (*spec.args, "--run-name", f"{objective}-{base_id(props, 'finetune')}"))
    runtime_env = {"working_dir": str(JOBS_DIR), "excludes": UPLOAD_EXCLUDES}
    submission_id = find_or_submit(client, spec, job_base, runtime_env, policy, log, needs_slice)
    try:
        return wait(client, spec, submission_id, props["timeout_s"], props["poll_s"], log), submission_id
    except JobFailed as err:
        if storage.PROBE_FAILED in str(err) and props.get("identity"):
            raise JobFailed(f"{err}\n{identity_hint(props['identity'])}") from None
        raise
    except KeyboardInterrupt:
        log(
            f"[{spec.name}] interrupted: job {submission_id} keeps running on the cluster; `pulumi up` "
            "re-attaches to it (and then scales the slice down), `pulumi destroy` stops it"
        )
        raise


def identity_hint(identity: dict) -> str:
    """The stack's side of a failed storage check: whom it granted the bucket to, and what to look at."""
    account, bucket = f"{identity['namespace']}/{identity['service_account']}", identity["bucket"]
    return (
        f"The Ray pods run as Kubernetes ServiceAccount {account}; the stack grants roles/storage.objectAdmin on "
        f"gs://{bucket} to its Workload Identity principal {identity['principal']}. Check both are there "
        f"(kubectl -n {identity['namespace']} get serviceaccount {identity['service_account']}; gcloud storage "
        f"buckets get-iam-policy gs://{bucket}). GKE's metadata server may also still have been starting on a new "
        "node: then `pulumi up` again runs the check again. Nothing was written to the bucket."
    )


def stop_active(props: dict, job_ids: dict, log: Log = default_log, tokens: TokenSource | None = None) -> list[str]:
    """Stop what is still running; checkpoints stay where they are."""
    client = connect(props["target"], tokens, retry_policy(props), log)
    stopped = []
    for submission_id in job_ids.values():
        if job_status(client, submission_id) in ACTIVE:
            log(f"stopping {submission_id}")
            client.stop_job(submission_id)
            stopped.append(submission_id)
    return stopped


def release_slice(props: dict, log: Log = default_log, tokens: TokenSource | None = None) -> None:
    """Scale the TPU worker group to 0 (on delete, after stopping the jobs), if the stack scales it."""
    scaler = slice_scaler(props, tokens, retry_policy(props), log)
    if not scaler:
        return
    try:
        scaler.down()
    except NoRayCluster as err:
        log(f"TPU slice: nothing to scale down: {err}")
