"""The `datasets` split grammar (train, train[:1024], train[10%:], train+test), and the one rule a held-out
split obeys: it never overlaps the training split.

What can be known from the text alone (absolute bounds) is checked here, by the job's settings and so by the
stack at preview (setting_checks.problems); the rest once the data's sizes are known (sft_data.load_splits), with the
same `overlap`. Torch-free: the stack imports it (infra/job_modules.py).
"""

from __future__ import annotations

import math
import re

_SPLIT_PART = r"[A-Za-z0-9_]+(\[(-?\d+%?)?:(-?\d+%?)?\])?"
_SPLIT = re.compile(rf"^{_SPLIT_PART}(\+{_SPLIT_PART})*$")
# A slice of absolute record numbers (no %, no negatives): what can be checked for overlap at preview.
_ABSOLUTE_PART = re.compile(r"^([A-Za-z0-9_]+)(?:\[(\d*):(\d*)\])?$")
EXAMPLES = "train, train[:1024], train[10%:] or train+test"


def is_split(text: str) -> bool:
    return bool(_SPLIT.fullmatch(text))


def absolute_slice(part: str) -> tuple[str, int, float] | None:
    """(split, first record, end) of one split part with absolute bounds: train -> (train, 0, inf),
    train[:1024] -> (train, 0, 1024); None for percentages, negative bounds or a sum (train+test)."""
    m = _ABSOLUTE_PART.fullmatch(part)
    if not m:
        return None
    return m.group(1), int(m.group(2) or 0), int(m.group(3)) if m.group(3) else math.inf


def overlap(held_out: list[tuple], train: list[tuple]) -> tuple[tuple, tuple] | None:
    """The first (held-out range, training range) that share records, each (split, start, end); else None."""
    for name, a, b in held_out:
        for other, c, d in train:
            if other == name and a < d and c < b:
                return (name, a, b), (other, c, d)
    return None


def known_ranges(spec: str) -> list[tuple]:
    """The absolute ranges of a split expression's parts whose bounds the text gives."""
    return [r for r in map(absolute_slice, spec.split("+")) if r is not None]


def eval_split_problem(eval_split: str, split: str) -> str | None:
    """What is wrong with the held-out split `eval_split` beside the training `split`, as far as the text tells:
    auto, none, or a split expression that never overlaps the training one. The message names the training split
    {split}, for the caller to write as its flag or config key (setting_checks.Problem)."""
    if eval_split == "none":
        return None
    if eval_split == "auto":
        if "+" in split:
            return (f"holds out records after the training slice or at its end, but {{split}} {split!r} joins "
                    "several; name a held-out split such as test[:64], or none")  # fmt: skip
        return None
    if not is_split(eval_split):
        return f"is not auto, none or a split expression such as train[1024:1088] ({EXAMPLES})"
    if overlap(known_ranges(eval_split), known_ranges(split)):
        return f"overlaps {{split}} {split!r}: held-out records must not be trained on"
    return None
