"""Talking to a Ray head's job API: directly, or through the GKE API server's service proxy.

Every request carries a fresh Google token (for GKE), has a timeout, and is retried while
what fails is transient (infra/runner/resilience.py). A submit is never resent blindly. Logs are
followed as bounded tails, each line printed once.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from infra.runner.kube_api import RERUN_HINT, api_server_url
from infra.runner.resilience import GoogleTokens, RetryPolicy, TokenSource, Unreachable, call_with_retries

LOG_FETCH_LINES = 1000  # the most of a job's log fetched per poll
LOG_TAIL_BUDGET_S = 30  # then the bounded tail gives way to the whole log

Log = Callable[[str], None]


def default_log(message: str) -> None:
    print(message, flush=True)


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
    address = service_proxy_address(
        api_server_url(target["endpoint"]), target["namespace"], target["service"], target["port"]
    )
    return job_client(address, headers, verify, tokens or GoogleTokens(), policy, log)


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
            if response.status_code == 200:  # the bytes are UTF-8; requests' .text would guess ISO-8859-1 for text/*
                return log_lines(response.content.decode("utf-8", errors="replace"))
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
