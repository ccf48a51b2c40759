"""Pulumi.yaml's job keys, written from the job's declarations (jobs/config/settings.py): one key for each setting the
stack exposes, with its type, its default and its description. The stack's own keys stay above the marker line,
written by hand; everything below it is this command's.

    python -m infra.config.pulumi_yaml            # rewrite Pulumi.yaml's job keys
    python -m infra.config.pulumi_yaml --check    # exit 1 if they are not current (tests/test_settings.py checks too)

Pulumi's project file allows a config key the types string, integer, boolean and array (no number: pulumi/pulumi
sdk/go/common/workspace/project.json), so a fractional setting (the learning rate) is a string the program reads
as a number and checks.
"""

from __future__ import annotations

import argparse
import re
import sys

import yaml

from infra import PULUMI_YAML
from infra.job_modules import settings

MARKER = "  # ---- the fine-tune's keys: written from jobs/config/settings.py by `python -m infra.config.pulumi_yaml`; edit them there"
TYPES = {bool: "boolean", int: "integer", float: "string", str: "string"}
# What a YAML 1.2 parser (the Pulumi CLI's, in Go) reads as something other than a string, though PyYAML's 1.1
# rules read some of it as one (a learning rate in exponent form): a string default like this is written in quotes.
NOT_A_STRING_IN_YAML_1_2 = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|0o[0-7]+|0x[0-9a-fA-F]+|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
    r"|true|True|TRUE|false|False|FALSE|null|Null|NULL|~|"
)


class _Dumper(yaml.SafeDumper):
    def represent_str(self, text: str) -> yaml.ScalarNode:
        quoted = NOT_A_STRING_IN_YAML_1_2.fullmatch(text) is not None
        return self.represent_scalar("tag:yaml.org,2002:str", text, style='"' if quoted else None)


_Dumper.add_representer(str, _Dumper.represent_str)


def stack_value(value) -> object:
    """A default as Pulumi.yaml gives it: a string for a number that is not whole, "" for no text."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    return value


def description(name: str) -> str:
    declared, field = settings.declared(settings.SETTINGS[name]), settings.SETTINGS[name]
    keys = settings.stack_keys()
    text = settings.help_text(name, lambda n: keys.get(n) or f"the job's {settings.flag(n)}")
    text = text[0].upper() + text[1:]
    if declared.recipes:
        recipes = ", ".join(f"{r} {settings.shown(v)}" for r, v in declared.recipes.items())
        text = f"(recipe; {recipes}) {text}"
    elif not declared.stack_default and field.default is not None:  # (None: the help says what decides it)
        text = f"(default {settings.shown(field.default)}) {text}"
    bounds = settings.bounds_text(name)
    return f"{text}{f'; {bounds}' if bounds else ''}. The job's {settings.flag(name)}."


def job_keys() -> dict[str, dict]:
    keys = {}
    for name, stack_key in settings.stack_keys().items():
        declared, kind = settings.declared(settings.SETTINGS[name]), settings.value_type(name)
        entry = {"type": TYPES[kind]}
        if declared.stack_default and not declared.recipes:
            entry["default"] = stack_value(settings.SETTINGS[name].default)
        keys[stack_key] = entry | {"description": description(name)}
    return keys


def rendered() -> str:
    """Pulumi.yaml as it should be: the hand-written part up to the marker, then the job keys."""
    text = PULUMI_YAML.read_text()
    if MARKER not in text:
        raise ValueError(f"{PULUMI_YAML} has no marker line: {MARKER.strip()!r}")
    head = text[: text.index(MARKER) + len(MARKER)]
    body = yaml.dump(
        job_keys(), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=118, allow_unicode=True
    )
    return head + "\n" + "".join(f"  {line}\n" for line in body.splitlines())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if Pulumi.yaml's job keys are not current")
    args = p.parse_args(argv)
    current = rendered()
    if args.check:
        if PULUMI_YAML.read_text() != current:
            print(
                f"{PULUMI_YAML.name}'s job keys are not current: run python -m infra.config.pulumi_yaml",
                file=sys.stderr,
            )
            return 1
        return 0
    PULUMI_YAML.write_text(current)
    print(f"wrote {len(job_keys())} job keys to {PULUMI_YAML}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
