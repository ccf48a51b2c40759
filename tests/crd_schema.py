"""Strict structural-schema validation, as an API server with strict field validation does it.

Walks a CRD's openAPIV3Schema: unknown fields are errors (unless the schema preserves
them), defaults are applied before `required` is checked, types, enums, int-or-string,
patterns and bounds are enforced. CEL rules (x-kubernetes-validations) are not evaluated.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "number": (int, float),
}


def load_schema(crd_file: Path, version: str = "v1") -> dict:
    crd = yaml.safe_load(crd_file.read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{crd_file} has no version {version}")


def _type_ok(value, schema: dict) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    t = schema.get("type")
    if t is None:
        return True
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def _walk(value, schema: dict, path: str, errors: list[str]) -> None:
    if value is None and schema.get("nullable"):
        return
    if not _type_ok(value, schema):
        want = "int-or-string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
        errors.append(f"{path}: expected {want}, got {type(value).__name__} {value!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        for i, item in enumerate(value):
            _walk(item, schema.get("items", {}), f"{path}[{i}]", errors)
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for name, sub in (props or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}: missing required field {name!r}")
        for name, item in value.items():
            child = f"{path}.{name}"
            if props is not None and name in props:
                _walk(item, props[name], child, errors)
            elif isinstance(extra, dict):
                _walk(item, extra, child, errors)
            elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                continue
            elif props is not None or extra is False:
                errors.append(f"{child}: unknown field")


def validate(obj: dict, schema: dict) -> list[str]:
    """Errors found (empty when valid); defaults are applied to a copy, as the server would."""
    errors: list[str] = []
    doc = copy.deepcopy(obj)
    # The API server owns apiVersion/kind/metadata; the CRD schema describes spec and status.
    top = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    _walk(
        top,
        {
            **schema,
            "properties": {
                k: v for k, v in schema.get("properties", {}).items() if k not in ("apiVersion", "kind", "metadata")
            },
        },
        "",
        errors,
    )
    return errors
