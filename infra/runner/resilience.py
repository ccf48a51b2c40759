"""Fresh credentials and bounded retries for the job resource's calls through the GKE API server.

A `pulumi up` can wait hours on a fine-tune, through control-plane upgrades and repairs: Google
access tokens expire after about an hour, and a single dropped connection or 502/503 must not
fail the wait. So every request goes through `call_with_retries`:

- the token comes from a `TokenSource`, refreshed before it expires; a 401 refreshes it once
  and retries before it counts as an answer;
- connection errors, timeouts and HTTP 429/500/502/503/504 are retried with exponential
  backoff and full jitter, for up to `RetryPolicy.budget_s` of continuous failure, then
  `Unreachable` is raised, saying what kept failing;
- anything else (200, 403, 404, 400, ...) is an answer, returned to the caller at once.
"""

from __future__ import annotations

import datetime
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T")


class TokenSource(Protocol):
    def token(self) -> str:
        """A bearer token that stays valid for a while yet."""

    def refresh(self) -> str:
        """A new token now (after the server said 401)."""


class GoogleTokens:
    """The caller's Application Default Credentials, as gke-gcloud-auth-plugin would use them."""

    def __init__(self, margin_s: float = 300, credentials=None):
        self.margin = datetime.timedelta(seconds=margin_s)
        self._credentials = credentials  # google.auth credentials; None: Application Default Credentials

    def _request(self):
        import google.auth.transport.requests

        return google.auth.transport.requests.Request()

    def token(self) -> str:
        if self._credentials is None:
            import google.auth

            self._credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
        expiry = self._credentials.expiry  # naive UTC, as google-auth keeps it
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        if not self._credentials.valid or (expiry is not None and expiry - now < self.margin):
            self._credentials.refresh(self._request())
        return self._credentials.token

    def refresh(self) -> str:
        self.token()
        self._credentials.refresh(self._request())
        return self._credentials.token


@dataclass(frozen=True)
class RetryPolicy:
    budget_s: float = 600.0  # continuous failure tolerated before giving up
    base_s: float = 1.0
    cap_s: float = 30.0

    def delays(self, rng: random.Random) -> Iterator[float]:
        """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^n)]."""
        n = 0
        while True:
            yield rng.uniform(0, min(self.cap_s, self.base_s * 2**n))
            n += 1


class Unreachable(RuntimeError):
    """A call kept failing for the whole retry budget."""


def call_with_retries(
    send: Callable[[str | None], tuple[int, T]],
    tokens: TokenSource | None,
    policy: RetryPolicy,
    what: str,
    hint: str = "",
    log: Callable[[str], None] = print,
    rng: random.Random | None = None,
) -> tuple[int, T]:
    """send(token) -> (HTTP status, response); retried as the module docstring says."""
    rng = rng or random.Random()
    delays = policy.delays(rng)
    deadline, refreshed = None, False
    while True:
        try:
            status, response = send(tokens.token() if tokens else None)
        except OSError as err:  # requests' and urllib's connection errors and timeouts are OSErrors
            failure = f"{type(err).__name__}: {err}"
        else:
            if status == 401 and tokens is not None and not refreshed:
                tokens.refresh()
                refreshed = True
                continue
            if status not in TRANSIENT_STATUS:
                return status, response
            failure = f"HTTP {status}"
        now = time.monotonic()
        deadline = deadline or now + policy.budget_s
        if now >= deadline:
            raise Unreachable(f"{what} kept failing for {policy.budget_s:.0f}s (last: {failure}). {hint}".strip())
        delay = min(next(delays), deadline - now)
        log(f"{what}: {failure}; retrying in {delay:.1f}s")
        time.sleep(delay)


class FixedToken:
    """One token that never changes (a stand-in, or a token handed over by hand)."""

    def __init__(self, value: str):
        self.value = value

    def token(self) -> str:
        return self.value

    def refresh(self) -> str:
        return self.value
