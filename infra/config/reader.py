"""Reading the stack's config: the raw strings the Pulumi CLI hands the program, the keys Pulumi.yaml declares
(with their defaults, which the CLI has already applied), typed values, and the problems found so far, every
one reported together at the end (ConfigError)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import cache

import yaml

from infra import PROJECT, PULUMI_YAML
from infra.cloud.capacity import HEAD_RESOURCES

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+)-gke\.(\d+))?$")

# Upper bounds of the stack's own counts, each with why (the job's settings carry theirs: jobs/config/settings.py).
LIMITS = {
    "jobTimeoutMinutes": (10080, "a week; the job resource waits this long, twice, for its jobs"),
    "sliceReadyTimeoutMinutes": (1440, "a day; GKE adds a slice within minutes when capacity exists"),
    "collectivesWorkers": (256, "local mode runs one CPU process per worker"),
    "finetuneWorkers": (256, "local mode runs one CPU process per worker"),
    "headCpus": (int(HEAD_RESOURCES["cpu"]), f"the head pod requests {HEAD_RESOURCES['cpu']} CPUs"),
}


class ConfigError(ValueError):
    """Every problem found in the stack's config, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid stack config:\n" + "\n".join(f"  - {p}" for p in problems))


@cache
def declared_keys() -> dict[str, dict]:
    """The project's config keys as Pulumi.yaml declares them (type, default, description)."""
    return yaml.safe_load(PULUMI_YAML.read_text())["config"]


def secret_keys() -> list[str]:
    return [name for name, decl in declared_keys().items() if decl.get("secret")]


def key(name: str) -> str:
    return f"{PROJECT}:{name}"


def parse_version(text: str) -> tuple[int, ...] | None:
    m = _VERSION.fullmatch(text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def version_at_least(version: str, minimum: str) -> bool:
    """MAJOR.MINOR means GKE's current patch of that minor, so only the minor is compared."""
    have, need = parse_version(version), parse_version(minimum)
    return have[:2] >= need[:2] if len(have) == 2 else have >= need


class Reader:
    """Raw config strings, the declared defaults, and the problems found so far."""

    def __init__(self, raw: Mapping[str, str | None]):
        self.raw, self.decl, self.problems = raw, declared_keys(), []

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def given(self, name: str) -> str | None:
        """The key's value if the user set it, else None. Only for keys without a declared default: the
        Pulumi CLI applies every Pulumi.yaml default before the program runs (pulumi/pulumi
        sdk/go/common/workspace, mergeConfig), so a key with one is never unset there."""
        if "default" in self.decl[name]:
            raise AssertionError(f"{name} has a default in Pulumi.yaml: whether it was given cannot be known")
        return self.raw.get(name)

    def value(self, name: str) -> str:
        v = self.raw.get(name)
        if v is None:
            default = self.decl[name].get("default")
            return "" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        return str(v)

    def typed(self, name: str, cast: Callable[[str], object], what: str | None = None):
        text = self.value(name)
        try:
            return cast(text)
        except ValueError:
            self.problem(f"{key(name)}: {text!r} is not {what or self.decl[name]['type']}")
            return None

    def boolean(self, name: str) -> bool:
        def cast(text: str) -> bool:
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"

        return bool(self.typed(name, cast))

    def positive(self, name: str, minimum: int = 1) -> int:
        n = self.typed(name, int)
        limit, why = LIMITS.get(name, (None, ""))
        if n is not None and n < minimum:
            self.problem(f"{key(name)}: {n} must be {'a positive integer' if minimum == 1 else f'at least {minimum}'}")
        elif n is not None and limit is not None and n > limit:
            self.problem(f"{key(name)}: {n} is more than {limit} ({why})")
        return n or 0

    def name(self, name: str, pattern: re.Pattern, limit: int, what: str) -> str:
        text = self.value(name)
        if len(text) > limit or not pattern.fullmatch(text):
            self.problem(f"{key(name)}: {text!r} must be {what} of at most {limit} characters")
        return text
