"""The `datasets` split grammar, as far as the stack checks it before anything runs: train,
train[:1024], train[10%:], train+test. The job resolves splits against the data itself
(jobs/sft_data.py); here only what is knowable at preview."""

from __future__ import annotations

import math
import re

_SPLIT_PART = r"[A-Za-z0-9_]+(\[(-?\d+%?)?:(-?\d+%?)?\])?"
_SPLIT = re.compile(rf"^{_SPLIT_PART}(\+{_SPLIT_PART})*$")
# A slice of absolute record numbers (no %, no negatives): what can be checked for overlap at preview.
_ABSOLUTE_PART = re.compile(r"^([A-Za-z0-9_]+)(?:\[(\d*):(\d*)\])?$")


def is_split(text: str) -> bool:
    return bool(_SPLIT.fullmatch(text))


def absolute_slice(part: str) -> tuple[str, int, float] | None:
    """(split, first record, end) of one split part with absolute bounds: train -> (train, 0, inf),
    train[:1024] -> (train, 0, 1024); None for percentages, negative bounds or a sum (train+test)."""
    m = _ABSOLUTE_PART.fullmatch(part)
    if not m:
        return None
    return m.group(1), int(m.group(2) or 0), int(m.group(3)) if m.group(3) else math.inf
