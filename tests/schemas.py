"""The schemas the tests hold what the stack emits to, each from its source at a pinned version: KubeRay's CRDs
(ray-project/kuberay, `ray-operator/config/crd/bases/`, tags v1.7.0 and v1.4.2) and Pulumi's project-file schema
(pulumi/pulumi, `sdk/go/common/workspace/project.json`).

They are data, not the project's code, and their test-data README asks that they not be copied into it; so each is
named here by its source, its version and its digest, and found, in order, in $SCHEMAS_DIR (laid out as
../shared is), in ../shared (this project's test data beside the checkout), in the cache .local/schemas, or else
downloaded once from GitHub at the pinned version and checked against the digest. A clone that can reach none of
them fails naming where it looked and how to give them: no test of them is skipped without a word.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
CACHE = ROOT / ".local" / "schemas"
KUBERAY_BASES = "https://raw.githubusercontent.com/ray-project/kuberay/{tag}/ray-operator/config/crd/bases/{file}"
# The commit whose project.json the test data equals (parsed: the test data's copy is re-indented); the Pulumi CLI
# validates Pulumi.yaml against this schema (pulumi/pulumi, sdk/go/common/workspace/project.go).
PULUMI_COMMIT = "fb113471c656a4ed62732cf9323f875314888294"
PULUMI_SCHEMA = f"https://raw.githubusercontent.com/pulumi/pulumi/{PULUMI_COMMIT}/sdk/go/common/workspace/project.json"


@dataclass(frozen=True)
class Schema:
    path: str  # where it lies under ../shared (and $SCHEMAS_DIR, and the cache)
    url: str  # its source at the pinned version
    sha256: str  # of its bytes; of its parsed JSON (sorted keys, compact) for a .json file


# KubeRay's CRDs by (tag, kind): the digest of each file; v1.7.0's lie at the folder's top, older tags below their own.
KUBERAY_SHA256 = {
    ("v1.7.0", "rayclusters"): "c44704442eef0c6721ad40c1d66782c8bd3fdab9d3344306a5820910a679baa1",
    ("v1.7.0", "rayservices"): "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab",
    ("v1.4.2", "rayclusters"): "84af0b910190ef0875581b7433f9e33bc86086a04c2039dd743f965f00fb364b",
    ("v1.4.2", "rayservices"): "57d824665599f3ba338c897d714d46a552401c523d684f377a95faaf779e7daf",
}
# what the stack's manifests must satisfy, newest first (GKE's Ray add-on may run the older)
KUBERAY_TAGS = tuple(dict.fromkeys(tag for tag, _ in KUBERAY_SHA256))
PULUMI_SHA256 = "15a0e225410aa4c6494679bff67fd22aaee388e4d2597c59b8db9da8aee354d6"


def kuberay(tag: str, kind: str) -> Schema:
    file = f"ray.io_{kind}.yaml"
    folder = "kuberay-crds/" + ("" if tag == KUBERAY_TAGS[0] else f"{tag}/")
    return Schema(folder + file, KUBERAY_BASES.format(tag=tag, file=file), KUBERAY_SHA256[tag, kind])


SCHEMAS = {f"{kind} {tag}": kuberay(tag, kind) for tag, kind in KUBERAY_SHA256} | {
    "pulumi project": Schema("pulumi-schema/project.json", PULUMI_SCHEMA, PULUMI_SHA256)
}


def digest(data: bytes, path: str) -> str:
    if path.endswith(".json"):
        data = json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()


def schema_file(name: str) -> Path:
    """The schema's file, as its pinned version holds it (its digest checked wherever it was found)."""
    schema = SCHEMAS[name]
    places = [Path(d) for d in (os.environ.get("SCHEMAS_DIR"),) if d] + [SHARED, CACHE]
    for place in places:
        file = place / schema.path
        if file.exists():
            if digest(file.read_bytes(), schema.path) != schema.sha256:
                raise AssertionError(f"{file} is not {name} at {schema.url} (its digest differs): remove it")
            return file
    try:
        with urllib.request.urlopen(schema.url, timeout=60) as answer:
            data = answer.read()
    except OSError as e:
        raise AssertionError(
            f"{name}'s schema is in none of {', '.join(map(str, places))} and could not be downloaded from "
            f"{schema.url} ({e}): put it in one of them, or set SCHEMAS_DIR to a folder laid out as ../shared"
        ) from e
    if digest(data, schema.path) != schema.sha256:
        raise AssertionError(f"{schema.url} is not the pinned {name} (its digest differs)")
    file = CACHE / schema.path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data)
    return file
