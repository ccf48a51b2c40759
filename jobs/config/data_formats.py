"""What data the fine-tune reads: file types, record formats, overlong records, the default splits.

Standard library only: the stack's config (infra/config/stack.py) and cost estimate (infra/prices.py) check and
count against these same facts before anything runs.
"""

import os

from runtime.outcome import JobInputError

LOCAL_DATA = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder
FORMATS = {  # name -> the columns that identify it
    "messages": ("messages",),
    "prompt/completion": ("prompt", "completion"),
    "instruction/context/response": ("instruction", "response"),
}
COLUMNS = ("messages", "prompt", "completion", "instruction", "context", "response")  # what --columns may name
OVERLONG = ("truncate", "drop")  # records longer than --seq-len; the first is the default
DEFAULT_DATASET = "databricks/databricks-dolly-15k"  # the walkthrough's records (Pulumi.yaml's dataset)
HUB_SPLIT = "train[:1024]"  # the default training split of a hub dataset (the walkthrough's) ...
FILE_SPLIT = "train"  # ... and of files: all of them (their one split)
EVAL_SHARE = 16  # the default eval split: 1/16 as many records as the training slice ...
EVAL_MOST = 256  # ... and no more than this: each eval scores them all


def auto_eval_count(records: int) -> int:
    """--eval-split auto's held-out records for a training slice of `records`: 1/EVAL_SHARE as many, rounded up,
    at most EVAL_MOST."""
    return min(EVAL_MOST, -(-records // EVAL_SHARE))


def is_local(ref: str) -> bool:
    """A path, not a hub id (`org/name`): it exists, or it is spelt like a path or a data file."""
    spelt_as_path = ref.startswith(("/", "./", "../", "~")) or ref.count("/") > 1
    return os.path.exists(ref) or spelt_as_path or os.path.splitext(ref)[1] in LOCAL_DATA


def is_file_source(ref: str) -> bool:
    return ref.startswith("gs://") or is_local(ref)


def default_split(dataset: str) -> str:
    """A file's records are the user's own: all of them; a hub dataset's, the walkthrough's first 1024."""
    return FILE_SPLIT if is_file_source(dataset) else HUB_SPLIT


def parse_columns(text: str | None) -> dict[str, str]:
    """`prompt=question,completion=answer` -> {"question": "prompt", "answer": "completion"} (old -> new)."""
    if not text:
        return {}
    mapping = {}
    for pair in text.split(","):
        new, sep, old = (part.strip() for part in pair.partition("="))
        if not sep or not old or new not in COLUMNS:
            raise JobInputError(
                f"--columns {text!r}: each entry is NEW=OLD with NEW one of {', '.join(COLUMNS)} "
                "(e.g. prompt=question,completion=answer)"
            )
        mapping[old] = new
    return mapping


def first_columns(path: str) -> list[str] | None:
    """A local data file's column names, from its first record (JSON Lines), header (CSV) or schema (Parquet); None
    where that cannot be told without reading it whole (a JSON array)."""
    import csv
    import json

    suffix = os.path.splitext(path)[1]
    if suffix == ".parquet":
        import pyarrow.parquet

        return list(pyarrow.parquet.read_schema(path).names)
    with open(path, encoding="utf-8", newline="") as f:
        if suffix == ".csv":
            return next(csv.reader(f), [])
        first = next((line for line in f if line.strip()), "")
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None  # (a JSON array or object spread over lines)
    return list(record) if isinstance(record, dict) else None
