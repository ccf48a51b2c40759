"""What --eval-tasks names: `heldout` (the held-out records as tasks, evaluation.py), lm-evaluation-harness tasks by
name (hellaswag, gsm8k, ...), or `none`; checked against the installed lm-eval's own task index.

Torch-free: the stack checks the names at preview (setting_checks.problems), the job before any worker starts. The
index is read only when a name other than heldout is given: lm-eval 0.4.13's TaskManager reads its ~15,000 task
YAMLs (about 7 s).
"""

from __future__ import annotations

import difflib
import functools
import re

HELDOUT = "heldout"
NONE = "none"
HELDOUT_TASKS = ("heldout", "heldout_loss")  # what `heldout` is scored as: the answers, and their loss
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def parse(value: str) -> tuple[str, ...]:
    """The names, in order, once each: "heldout, gsm8k" -> ("heldout", "gsm8k"); "none" -> ()."""
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    return () if names == (NONE,) else names


def named(value: str) -> tuple[str, ...]:
    """The lm-eval tasks named besides heldout."""
    return tuple(n for n in parse(value) if n != HELDOUT)


@functools.cache
def lm_eval_index() -> frozenset[str]:
    """Every task, group and tag the installed lm-eval knows (what `lm_eval --tasks list` lists)."""
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager().all_tasks)


def problem(value: str) -> str | None:
    """Why the job would refuse `value`, in a Problem's words (read after the value), or None."""
    names = [n.strip() for n in value.split(",")]
    if not value.strip() or any(not n for n in names):
        return f"is not a list of task names such as {HELDOUT} or {HELDOUT},gsm8k (or {NONE})"
    if NONE in names and len(names) > 1:
        return f"names {NONE} beside other tasks: give {NONE} alone, or the tasks"
    malformed = [n for n in names if not NAME.fullmatch(n)]
    if malformed:
        return f"has {', '.join(map(repr, malformed))}, not a task name (letters, digits, _ . -)"
    asked = [n for n in named(value) if n != NONE]
    if not asked:
        return None
    import lm_eval

    index = lm_eval_index()
    unknown = [n for n in asked if n not in index]
    if not unknown:
        return None
    closest = {n: difflib.get_close_matches(n, index, n=3, cutoff=0.6) for n in unknown}
    said = "; ".join(f"{n} (closest: {', '.join(c)})" if c else n for n, c in closest.items())
    return (f"names tasks lm-eval {lm_eval.__version__} does not know: {said}. Give {HELDOUT}, {NONE}, or names "
            f"`lm_eval --tasks list` shows")  # fmt: skip
