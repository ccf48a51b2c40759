"""How a job ends: a refused input (JobInputError: exit status 2, its message, no traceback), a failed check
(exit status 1), or its result line, the last line it prints, which the job resource parses."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

RESULT_PREFIX = "JOB_RESULT_JSON: "


class JobInputError(ValueError):
    """A bad flag or input, reported before any worker starts."""


def print_result(result: dict) -> None:
    """The last line a job prints: what the job resource parses."""
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)


def exit_code(run: Callable[[], dict], succeeded: Callable[[dict], bool] = lambda _: True) -> int:
    """A job's exit status: 2 for bad input (message, no traceback), 1 when its checks fail."""
    try:
        result = run()
    except JobInputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    print_result(result)
    return 0 if succeeded(result) else 1
