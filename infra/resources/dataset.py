"""A dataset file from this machine, uploaded to the stack's bucket for the fine-tune to read.

The object's name carries the file's content hash, so an edited file is a new object and a new
gs:// URI in the job's arguments (a new run), and an unchanged one changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_gcp as gcp

from infra import PROJECT
from infra.config.job import object_name


def records_in(path: str) -> int | None:
    """How many records a JSON Lines file (its non-blank lines) or a JSON array holds, for the estimate at
    preview; None for other formats (csv rows can span lines; parquet would need its reader)."""
    file = Path(path)
    if file.suffix == ".jsonl":
        with file.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if file.suffix == ".json":
        try:
            records = json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError):
            return None  # the job names what is wrong with it
        return len(records) if isinstance(records, list) else None
    return None


@dataclass(frozen=True, kw_only=True)
class DatasetFileArgs:
    path: str  # the file on this machine
    bucket: pulumi.Input[str]


class DatasetFile(pulumi.ComponentResource):
    """datasetFile, as an object in the checkpoint bucket (the pods already read and write there)."""

    def __init__(self, name: str, args: DatasetFileArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{PROJECT}:infra:DatasetFile", name, None, opts)
        self.object = gcp.storage.BucketObject(
            name,
            bucket=args.bucket,
            name=object_name(args.path),
            source=pulumi.FileAsset(args.path),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.uri = pulumi.Output.concat("gs://", self.object.bucket, "/", self.object.name)
        self.register_outputs({"uri": self.uri})
