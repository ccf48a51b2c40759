"""Runs the two jobs of `jobs/` on a Ray head, once each, and returns what they produced.

No Pulumi here: the dynamic resource (infra/training.py), `make local` and the tests call
these functions directly. A job's submission id is a hash of what defines it, so a second
`up` attaches to the job the first one started instead of starting another.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.kube_api import RERUN_HINT, KubeApi
from infra.resilience import GoogleTokens, RetryPolicy, TokenSource, Unreachable, call_with_retries
from infra.slice_scaler import SliceScaler

JOBS_DIR = Path(__file__).resolve().parent.parent / "jobs"
UPLOAD_EXCLUDES = ["__pycache__", "*.pyc", "tiny_assets.py"]
ACTIVE, DONE, BROKEN = {"PENDING", "RUNNING"}, "SUCCEEDED", {"FAILED", "STOPPED"}
RESULT_PREFIX = "JOB_RESULT_JSON: "
LOG_TAIL_LINES = 50
LOG_FETCH_LINES = 1000  # the most of a job's log fetched per poll
LOG_TAIL_BUDGET_S = 30  # then the bounded tail gives way to the whole log
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


class Refused(RuntimeError):
    """The API server or the head said no in a way no retry can change (403, no such service)."""


class SubmitUncertain(RuntimeError):
    """A submit failed in transit: it may or may not have reached the head."""


def _is_kubernetes_status(response) -> bool:
    """The API server's own error body (kind: Status), as opposed to an answer from Ray behind it."""
    try:
        return response.json().get("kind") == "Status"
    except ValueError:
        return False


def job_client(address: str, headers: dict, verify, tokens: TokenSource | None, policy: RetryPolicy, log: Log):
    """A JobSubmissionClient whose every request has a fresh token, a timeout and bounded retries."""
    import requests
    from ray._private.authentication.http_token_authentication import format_authentication_http_error
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    class ResilientJobClient(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, *, data=None, json_data=None, budget_s=None, **kwargs):
            kwargs.setdefault("timeout", 60)  # a silent connection must not stall the wait forever
            call_policy = policy if budget_s is None else RetryPolicy(budget_s, policy.base_s, policy.cap_s)

            def send(token: str | None):
                sent = {**self._headers, **({"Authorization": f"Bearer {token}"} if token else {})}
                response = requests.request(
                    method, self._address + endpoint, cookies=self._cookies, data=data, json=json_data,
                    headers=sent, verify=self._verify, **kwargs,
                )  # fmt: skip
                return response.status_code, response

            what = f"{method} {self._address}{endpoint}"
            if method == "POST" and endpoint.rstrip("/") == "/api/jobs":
                # Not idempotent: never resent blindly (find_or_submit looks the id up first).
                try:
                    status, response = call_with_retries(send, tokens, RetryPolicy(budget_s=0), what, log=log)
                except Unreachable as err:
                    raise SubmitUncertain(str(err)) from None
            else:
                status, response = call_with_retries(send, tokens, call_policy, what, hint=RERUN_HINT, log=log)
            if status == 403:
                raise Refused(f"{what}: HTTP 403, refused: {response.text[:500]}")
            if status == 404 and _is_kubernetes_status(response):
                raise Refused(
                    f"{what}: HTTP 404 from the API server: {response.text[:300]}; is the RayCluster's head "
                    "service there (kubectl get svc)?"
                )
            # as Ray's own client does: a 401 (still, after one refresh) names the missing token
            formatted = format_authentication_http_error(status, response.text)
            if formatted:
                raise AuthenticationError(formatted)
            return response

    return ResilientJobClient(address, headers=headers, verify=verify)


def connect(target: dict, tokens: TokenSource | None = None, policy: RetryPolicy | None = None, log: Log = default_log):
    """A job client: {"kind": "local", "address"}, or {"kind": "gke", ...} via the API server's service proxy.

    For GKE, `tokens` defaults to the caller's Google credentials, refreshed as they near expiry.
    """
    import base64

    policy = policy or RetryPolicy()
    headers = ray_auth_headers()
    if target["kind"] == "local":
        return job_client(target["address"], headers, True, None, policy, log)
    verify: bool | str = True
    if target.get("ca_certificate"):
        with tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False) as ca:
            ca.write(base64.b64decode(target["ca_certificate"]))
        verify = ca.name
    endpoint = target["endpoint"]
    api_server = endpoint if "://" in endpoint else f"https://{endpoint}"
    address = service_proxy_address(api_server, target["namespace"], target["service"], target["port"])
    return job_client(address, headers, verify, tokens or GoogleTokens(), policy, log)


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


def log_lines(text: str) -> list[str]:
    """Lines ending in \\n (the last one maybe not yet). Not str.splitlines: a progress bar's \\r
    does not end a line, and splitting there would count one line as several."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


class LogFollower:
    """Prints each new line of a job's log once, fetching only a bounded tail per poll.

    Ray's /api/jobs/ID/logs returns the whole log every time; the dashboard's log API returns
    its last `lines`. While the log is shorter than that, the tail is the whole log and the new
    lines are simply those past the count printed. Past it, they are those after where the
    printed lines end (found by their last few); if none of those are in the tail, more than
    `lines` came since, and the follower says so.
    """

    ANCHOR = 8

    def __init__(self, client, submission_id: str, prefix: str, log: Log, lines: int = LOG_FETCH_LINES):
        self.client, self.submission_id, self.prefix, self.log, self.lines = client, submission_id, prefix, log, lines
        self.shown: list[str] = []  # the last ANCHOR lines printed
        self.count = 0  # lines printed
        self.window: list[str] = []

    def fetch(self, driver_node_id: str) -> list[str]:
        # the log API finds a job's driver log only given the node it runs on
        path = f"/api/v0/logs/file?node_id={driver_node_id}&submission_id={self.submission_id}&lines={self.lines}"
        try:
            response = self.client._do_request("GET", path, budget_s=LOG_TAIL_BUDGET_S)
            if response.status_code == 200:
                return log_lines(response.text)
        except Unreachable:
            pass
        # a head without this API, or one failing at it: the whole log, cut here
        return log_lines(self.client.get_job_logs(self.submission_id))[-self.lines :]

    def poll(self, driver_node_id: str | None, final: bool = False) -> str:
        """Print what is new; with final, also a last line that has no newline yet. Returns the tail fetched."""
        if not driver_node_id:  # not started yet: no log
            return "".join(self.window)
        self.window = self.fetch(driver_node_id)
        partial = bool(self.window) and not self.window[-1].endswith("\n")
        complete = self.window[:-1] if partial and not final else self.window
        new = complete[self.count :] if len(self.window) < self.lines else self._after_shown(complete)
        for line in new:
            self.log(f"{self.prefix} {line.rstrip()}")
        self.shown = (self.shown + new)[-self.ANCHOR :]
        self.count += len(new)
        return "".join(self.window)

    def _after_shown(self, window: list[str]) -> list[str]:
        """What follows the longest run of the last printed lines found in the window (the latest such run)."""
        for k in range(min(len(self.shown), self.ANCHOR), 0, -1):
            anchor = self.shown[-k:]
            for start in range(len(window) - k, -1, -1):
                if window[start : start + k] == anchor:
                    return window[start + k :]
        if self.shown:
            self.log(f"{self.prefix} ... (more than {self.lines} new lines since the last poll; showing the last ones)")
        return window


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
    endpoint = target["endpoint"]
    api = KubeApi(
        endpoint if "://" in endpoint else f"https://{endpoint}",
        tokens or GoogleTokens(),
        target.get("ca_certificate"),
        policy,
        log,
    )
    return SliceScaler(
        api, target["namespace"], tpu["ray_cluster"], tpu["group"], tpu["hosts"], tpu["ready_timeout_s"],
        poll_s=min(props["poll_s"], 10), log=log,
    )  # fmt: skip


def run_pipeline(props: dict, log: Log = default_log, tokens: TokenSource | None = None) -> dict:
    """Collectives check, and only if it passes the fine-tune; returns the resource's outputs.

    With a scaler, the slice comes up before the first job that needs it and goes back to 0
    once the jobs have ended, succeeded or not. Interrupted (Ctrl-C, SIGTERM) while waiting, it
    says which job keeps running and re-raises: nothing is stopped or scaled down, and the next
    `pulumi up` attaches to that job.
    """
    policy = retry_policy(props)
    tokens = tokens or (GoogleTokens() if props["target"]["kind"] == "gke" else None)
    client = connect(props["target"], tokens, policy, log)
    scaler = slice_scaler(props, tokens, policy, log)
    needs_slice = scaler.up if scaler else lambda: None
    results, ids, slice_hours = {}, {}, 0.0
    try:
        for spec in job_specs(props["settings"]):
            results[spec.name], ids[spec.name] = run_job(client, props, spec, policy, needs_slice, log)
    finally:
        # Not after an interrupt or an unreachable API server: a job may still be running on the slice.
        leave_up = isinstance(sys.exc_info()[1], KeyboardInterrupt | Unreachable)
        if scaler and scaler.up_since is not None and not leave_up:
            slice_hours = scale_down(scaler, log)
    finetune = results["finetune"]
    return {
        "checkpoint": finetune["checkpoint"],
        "checkpoints": finetune["checkpoints"],
        "metrics": finetune["metrics"],
        "history": finetune.get("history", []),
        "loss_curve": finetune.get("loss_curve"),
        "collectives": results["collectives"],
        "job_ids": ids,
        "slice_hours": round(slice_hours, 4),
    }


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
    if spec.name == "finetune":
        # One Ray Train run per definition: a new attempt resumes from its checkpoints.
        spec = JobSpec(spec.name, spec.script, (*spec.args, "--run-name", f"sft-{job_base}"))
    submission_id = find_or_submit(client, spec, job_base, {"working_dir": str(JOBS_DIR), "excludes": UPLOAD_EXCLUDES},
                                   policy, log, needs_slice)  # fmt: skip
    try:
        return wait(client, spec, submission_id, props["timeout_s"], props["poll_s"], log), submission_id
    except KeyboardInterrupt:
        log(
            f"[{spec.name}] interrupted: job {submission_id} keeps running on the cluster; `pulumi up` "
            "re-attaches to it (and then scales the slice down), `pulumi destroy` stops it"
        )
        raise


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
    if scaler:
        scaler.down()
