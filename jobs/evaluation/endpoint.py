"""An OpenAI-compatible endpoint, waited for and asked: the wait that `up`'s served evaluation (rescore.py
--endpoint --wait-s, a job on the training cluster) and make local's rehearsal (infra/serving/rehearsal.py) share.
Standard library only: it runs wherever the scoring does.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

# What a scoring job prints when the endpoint never answered: `up` then scales the serving replicas down to 0.
NEVER_ANSWERED = "the endpoint never answered"


class ServerNotReady(RuntimeError):
    """The endpoint did not list the model in time, or its server ended first."""


def listed_models(url: str, timeout_s: float = 5.0) -> list[str]:
    """The model ids GET {url}/models lists; [] while the server is not answering."""
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=timeout_s) as response:
            return [m["id"] for m in json.load(response).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError):
        return []


def wait_until_ready(url: str, model: str, timeout_s: float, *, alive: Callable[[], bool] = lambda: True,
                     log_tail: Callable[[], str] = lambda: "", say: Callable[[str], None] = print,
                     every_s: float = 1.0, report_every_s: float = 15.0) -> float:  # fmt: skip
    """Waits until {url}/models lists `model` and a one-token completion answers (a replica is up, not only the
    ingress); returns the seconds it took. A progress line every `report_every_s`; raises ServerNotReady with the
    end of the server's log when `alive()` turns false or `timeout_s` passes."""
    started = last_report = time.monotonic()
    while True:
        if model in listed_models(url) and completes(url, model):  # (the first completion waits for the replica)
            waited = time.monotonic() - started
            say(f"serving: {model} answers at {url} after {waited:.0f}s")
            return waited
        waited = time.monotonic() - started
        if not alive():
            raise ServerNotReady(f"the server for {model} ended after {waited:.0f}s without answering at {url}; "
                                 f"the end of its log:\n{log_tail()}")  # fmt: skip
        if waited > timeout_s:
            raise ServerNotReady(f"{model} did not answer at {url} within {timeout_s:.0f}s (a cold start: the "
                                 f"weights loaded, the engine compiled); the end of the server's log:\n{log_tail()}")  # fmt: skip
        if time.monotonic() - last_report >= report_every_s:
            say(f"serving: waiting for {model} at {url} ({waited:.0f}s of at most {timeout_s:.0f}s)")
            last_report = time.monotonic()
        time.sleep(every_s)


def post(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def completes(url: str, model: str) -> bool:
    try:
        return bool(post(f"{url}/completions", {"model": model, "prompt": "Hi", "max_tokens": 1}, 60)["choices"])
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return False


def chat(url: str, model: str, text: str, max_tokens: int = 32) -> str:
    """One greedy chat completion's answer."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return post(f"{url}/chat/completions", body)["choices"][0]["message"]["content"]


def serve_status(dashboard: str) -> str:
    """What Ray Serve says of its applications and their deployments (the serving cluster's dashboard,
    /api/serve/applications/): on a cluster, the server's own account of why nothing answers."""
    try:
        with urllib.request.urlopen(f"{dashboard.rstrip('/')}/api/serve/applications/", timeout=10) as response:
            applications = json.load(response).get("applications", {})
    except (urllib.error.URLError, OSError, ValueError) as err:
        return f"(Serve's status unreadable at {dashboard}: {err})"
    lines = []
    for name, app in applications.items():
        lines.append(f"application {name}: {app.get('status')} {app.get('message') or ''}".rstrip())
        for deployment, state in (app.get("deployments") or {}).items():
            lines.append(f"  {deployment}: {state.get('status')} {state.get('message') or ''}".rstrip())
    return "\n".join(lines) or "(no Serve application)"
