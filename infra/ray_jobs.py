"""Runs the two jobs of `jobs/` on a Ray head, once each, and returns what they produced.

No Pulumi here: the dynamic resource (infra/training.py), `make local` and the tests call
these functions directly. A job's submission id is a hash of what defines it, so a second
`up` attaches to the job the first one started instead of starting another.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.kube_api import google_access_token

JOBS_DIR = Path(__file__).resolve().parent.parent / "jobs"
UPLOAD_EXCLUDES = ["__pycache__", "*.pyc", "tiny_assets.py"]
ACTIVE, DONE, BROKEN = {"PENDING", "RUNNING"}, "SUCCEEDED", {"FAILED", "STOPPED"}
RESULT_PREFIX = "JOB_RESULT_JSON: "
LOG_TAIL_LINES = 50
MAX_ATTEMPTS = 20

Log = Callable[[str], None]


class JobFailed(RuntimeError):
    """A job ended without success; the message carries its id, status and last log lines."""


def default_log(message: str) -> None:
    print(message, flush=True)


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


def job_specs(settings: dict) -> list[JobSpec]:
    """The collectives check, then the fine-tune, with arguments from the stack's settings."""
    placement = ["--backend", settings["backend"]]
    if settings["backend"] == "tpu":
        placement += ["--topology", settings["topology"], "--accelerator-type", settings["accelerator_type"]]
    collectives = [*placement]
    finetune = [*placement]
    if settings["backend"] != "tpu":
        collectives += ["--num-workers", str(settings["collectives_workers"])]
        finetune += ["--num-workers", str(settings["finetune_workers"])]
    finetune += [
        "--model", settings["model"],
        "--dataset", settings["dataset"],
        "--split", settings["dataset_split"],
        "--epochs", str(settings["epochs"]),
        "--batch-size", str(settings["batch_size"]),
        "--seq-len", str(settings["seq_len"]),
        "--packing" if settings["packing"] else "--no-packing",
        "--lr", str(settings["learning_rate"]),
        "--storage-path", settings["storage_path"],
    ]  # fmt: skip
    return [
        JobSpec("collectives", "ray_core_collectives.py", tuple(collectives)),
        JobSpec("finetune", "ray_train_llm_finetune.py", tuple(finetune)),
    ]


# What a run is: change any of these and the jobs run again. How to reach the head and how
# long to wait are not in it.
DEFINING_KEYS = ("stack", "cluster", "image", "code", "settings")


def base_id(props: dict, job: str) -> str:
    """Stable per stack, job and everything that defines the job; attempts add a suffix."""
    defining = {k: props[k] for k in DEFINING_KEYS} | {"job": job}
    digest = hashlib.sha256(json.dumps(defining, sort_keys=True).encode()).hexdigest()[:16]
    return f"{props['stack']}-{job}-{digest}"


# ---- reaching the head --------------------------------------------------------------------------


def ray_auth_headers() -> dict[str, str]:
    """Ray's token, when its token auth is on: in the header Ray reads behind proxies."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    token_file = Path.home() / ".ray" / "auth_token"
    if not token and os.environ.get("RAY_AUTH_MODE") == "token" and token_file.exists():
        token = token_file.read_text().strip()
    return {"X-Ray-Authorization": f"Bearer {token}"} if token else {}


def service_proxy_address(api_server: str, namespace: str, service: str, port: int) -> str:
    """The Kubernetes API server's proxy to a ClusterIP service: no LoadBalancer, no port-forward."""
    return f"{api_server.rstrip('/')}/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy"


def connect(target: dict, token_source: Callable[[], str] = google_access_token):
    """A JobSubmissionClient: {"kind": "local", "address"}, or {"kind": "gke", ...} via the API server."""
    import base64

    from ray.job_submission import JobSubmissionClient

    headers = ray_auth_headers()
    if target["kind"] == "local":
        return JobSubmissionClient(target["address"], headers=headers)
    verify: bool | str = True
    if target.get("ca_certificate"):
        with tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False) as ca:
            ca.write(base64.b64decode(target["ca_certificate"]))
        verify = ca.name
    endpoint = target["endpoint"]
    api_server = endpoint if "://" in endpoint else f"https://{endpoint}"
    headers["Authorization"] = f"Bearer {token_source()}"
    address = service_proxy_address(api_server, target["namespace"], target["service"], target["port"])
    return JobSubmissionClient(address, headers=headers, verify=verify)


# ---- one job --------------------------------------------------------------------------------------


def job_status(client, submission_id: str) -> str | None:
    try:
        return str(client.get_job_info(submission_id).status)
    except RuntimeError as err:
        if "404" in str(err) or "does not exist" in str(err):
            return None
        raise


def parse_result(logs: str) -> dict | None:
    lines = [line for line in logs.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None


def tail(logs: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(logs.splitlines()[-lines:])


def find_or_submit(client, spec: JobSpec, job_base_id: str, runtime_env: dict, log: Log) -> str:
    """Attach to a live or finished attempt; submit a new attempt only after a failed or stopped one."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        submission_id = f"{job_base_id}-a{attempt}"
        status = job_status(client, submission_id)
        if status is None:
            log(f"[{spec.name}] submitting {submission_id}: {spec.entrypoint}")
            client.submit_job(entrypoint=spec.entrypoint, submission_id=submission_id, runtime_env=runtime_env)
            return submission_id
        if status in ACTIVE:
            log(f"[{spec.name}] {submission_id} is already {status}; attaching to it")
            return submission_id
        if status == DONE:
            log(f"[{spec.name}] {submission_id} already SUCCEEDED; reusing its result")
            return submission_id
        log(f"[{spec.name}] {submission_id} ended {status}; trying a new attempt")
    raise JobFailed(f"[{spec.name}] {MAX_ATTEMPTS} attempts of {job_base_id} all failed; change an input or clear them")


def wait(client, spec: JobSpec, submission_id: str, timeout_s: float, poll_s: float, log: Log) -> dict:
    """Stream status changes and new log lines until the job ends; its parsed result on success."""
    deadline = time.monotonic() + timeout_s
    status, shown = None, 0
    while True:
        current = job_status(client, submission_id)
        if current != status:
            log(f"[{spec.name}] {submission_id}: {current}")
            status = current
        logs = client.get_job_logs(submission_id)
        for line in logs[shown:].splitlines():
            log(f"[{spec.name}] {line}")
        shown = len(logs)
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


def run_pipeline(props: dict, log: Log = default_log, token_source: Callable[[], str] = google_access_token) -> dict:
    """Collectives check, and only if it passes the fine-tune; returns the resource's outputs."""
    client = connect(props["target"], token_source)
    runtime_env = {"working_dir": str(JOBS_DIR), "excludes": UPLOAD_EXCLUDES}
    results, ids = {}, {}
    for spec in job_specs(props["settings"]):
        job_base = base_id(props, spec.name)
        if spec.name == "finetune":
            # One Ray Train run per definition: a new attempt resumes from its checkpoints.
            spec = JobSpec(spec.name, spec.script, (*spec.args, "--run-name", f"sft-{job_base}"))
        ids[spec.name] = find_or_submit(client, spec, job_base, runtime_env, log)
        results[spec.name] = wait(client, spec, ids[spec.name], props["timeout_s"], props["poll_s"], log)
    finetune = results["finetune"]
    return {
        "checkpoint": finetune["checkpoint"],
        "checkpoints": finetune["checkpoints"],
        "metrics": finetune["metrics"],
        "history": finetune.get("history", []),
        "loss_curve": finetune.get("loss_curve"),
        "collectives": results["collectives"],
        "job_ids": ids,
    }


def stop_active(
    props: dict, job_ids: dict, log: Log = default_log, token_source: Callable[[], str] = google_access_token
) -> list[str]:
    """Stop what is still running; checkpoints stay where they are."""
    client = connect(props["target"], token_source)
    stopped = []
    for submission_id in job_ids.values():
        if job_status(client, submission_id) in ACTIVE:
            log(f"stopping {submission_id}")
            client.stop_job(submission_id)
            stopped.append(submission_id)
    return stopped
