"""GRPO's --rewards and --reward-weights as written: the entries, their weights, and what is wrong with one before
anything is loaded (the job before Ray, the stack at preview). training/rewards.py turns an entry into its function."""

from __future__ import annotations

import re

BUILT_INS = ("answer_match", "gsm8k", "format")
FORMS = f"{', '.join(BUILT_INS)}, regex:PATTERN or FILE.py:FUNCTION"


def entries(rewards: str) -> list[str]:
    """--rewards' entries, in order (comma-separated; a regex: entry takes the rest of the text, commas included)."""
    out, rest = [], rewards.strip()
    while rest:
        if rest.startswith("regex:"):
            return [*out, rest]
        head, _, rest = rest.partition(",")
        out.append(head.strip())
        rest = rest.strip()
    return out


def file_and_function(entry: str) -> tuple[str, str] | None:
    """A FILE.py:FUNCTION entry's parts, else None."""
    path, sep, name = entry.rpartition(":")
    return (path, name) if sep and path.endswith(".py") and name.isidentifier() else None


def entry_problem(entry: str) -> str | None:
    if entry in BUILT_INS or file_and_function(entry):
        return None
    if entry.startswith("regex:"):
        try:
            re.compile(entry.removeprefix("regex:"))
        except re.error as err:
            return f"{entry!r}, which is not a regular expression ({err})"
        return None
    return f"{entry!r}, which is not one of {FORMS}"


def weights(rewards: str, reward_weights: str | None) -> list[float]:
    """Each entry's weight: --reward-weights' numbers (checked by `problem`), else 1 each."""
    if reward_weights is None:
        return [1.0] * len(entries(rewards))
    return [float(w) for w in reward_weights.split(",")]


def problem(rewards: str, reward_weights: str | None) -> tuple[str, str] | None:
    """(the setting, what is wrong) for --rewards and --reward-weights, or None."""
    found = entries(rewards)
    if not found:
        return "rewards", f"names no reward: give one or more of {FORMS}"
    for entry in found:
        if why := entry_problem(entry):
            return "rewards", f"names {why}"
    if reward_weights is not None:
        try:
            given = [float(w) for w in reward_weights.split(",")]
        except ValueError:
            return "reward_weights", "is not comma-separated numbers such as 1,0.5"
        if len(given) != len(found):
            return "reward_weights", f"gives {len(given)} weights for {len(found)} rewards ({{rewards}}): one each"
    return None
