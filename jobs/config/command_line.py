"""The job's command line, derived from the settings table (settings.py): argparse with every default and bound
in --help, the settings it gives (`from_args`), the command line that gives settings back (`to_argv`:
settings -> argv -> settings is the identity, which the stack's job resource relies on), and the paths it names
made absolute for the workers (`for_this_machine`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, replace
from pathlib import Path

from config import reward_specs
from config.settings import (
    PLACEMENT,
    RECIPES,
    SETTINGS,
    FinetuneSettings,
    bounds_text,
    declared,
    flag,
    help_text,
    shown,
    value_type,
    with_recipe,
)
from runtime.outcome import JobInputError


def default_text(name: str) -> str:
    """--help's tail: the default (or each recipe's) and the bounds."""
    d, default, bounds = declared(SETTINGS[name]), SETTINGS[name].default, bounds_text(name)
    if d.recipes:
        parts = ["recipe: " + ", ".join(f"{r} {shown(v)}" for r, v in d.recipes.items())]
    else:
        parts = [] if default is None else [f"default: {shown(default)}"]
    parts += [bounds] if bounds else []
    return f"({'; '.join(parts)})" if parts else ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Gemma 4 supervised fine-tune with Ray Train and FSDP2. Settings marked "
                                "(recipe) default to --recipe's value.")  # fmt: skip
    add_flags(p, SETTINGS)
    return p


def add_flags(p: argparse.ArgumentParser, names) -> None:
    """The named settings' flags on `p` (the collectives check takes the placement's)."""
    for name in names:
        f = SETTINGS[name]
        d, kind = declared(f), value_type(name)
        text = f"{help_text(name, flag)} {default_text(name)}".strip().replace("%", "%%")  # (argparse formats with %)
        options = {"help": text, "default": None if d.recipes else f.default}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options |= {"type": kind, "metavar": "N" if kind in (int, float) else "TEXT"}
            if d.choices:
                options |= {"choices": d.choices, "metavar": "{" + ",".join(map(str, d.choices)) + "}"}
        p.add_argument(flag(name), *d.aliases, dest=name, **options)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def from_args(args: argparse.Namespace) -> FinetuneSettings:
    """The run's settings: the flags, with what a flag left unset taken from --recipe, and the storage path's
    default ($STORAGE_PATH, else ~/ray_results)."""
    values = with_recipe(vars(args), args.recipe if args.recipe in RECIPES else "default")
    values["storage_path"] = (
        values["storage_path"] or os.environ.get("STORAGE_PATH") or str(Path.home() / "ray_results")
    )
    return FinetuneSettings(**values)


def to_argv(settings: FinetuneSettings) -> list[str]:
    """The command line that gives `settings` back (from_args(parse_args(to_argv(s))) == s): every setting."""
    return argv_of(asdict(settings))


def argv_of(values: dict) -> list[str]:
    """Flags for setting values: booleans as --x / --no-x, floats as Python writes them (repr round-trips), None
    left out."""
    argv = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        else:  # one word, so a value that starts with a dash is not read as a flag
            argv.append(f"{flag(name)}={repr(value) if isinstance(value, float) else value}")
    return argv


def placement_argv(s: FinetuneSettings, num_workers: int | None) -> list[str]:
    """The collectives check's command line: the placement of `s`, with its own worker count off TPU."""
    return argv_of({n: getattr(s, n) for n in PLACEMENT} | {"num_workers": num_workers})


def for_this_machine(s: FinetuneSettings) -> FinetuneSettings:
    """Local paths made absolute (the workers do not run in this directory), after checking the model's and the
    tokenizer's exist; gs:// and hub ids as they are (a gs:// model is checked where it is copied down:
    storage.model_directory)."""
    from config.data_formats import is_local

    absolute = {}
    for name in ("model", "tokenizer"):
        ref = getattr(s, name)
        if ref and is_local(ref) and not ref.startswith("gs://"):
            if not Path(ref).expanduser().is_dir():
                raise JobInputError(f"{flag(name)} {ref!r} does not exist (give a directory or a hub id)")
            absolute[name] = str(Path(ref).expanduser().resolve())
    if is_local(s.dataset) and not s.dataset.startswith("gs://"):
        absolute["dataset"] = str(Path(s.dataset).expanduser().resolve())
    if "://" not in s.storage_path:
        absolute["storage_path"] = str(Path(s.storage_path).expanduser().resolve())
    if s.objective == "grpo":  # a FILE.py:FUNCTION reward on this machine, as the dataset
        absolute["rewards"] = ",".join(
            f"{Path(f[0]).expanduser().resolve()}:{f[1]}" if (f := reward_specs.file_and_function(e)) and
            "://" not in f[0] else e for e in reward_specs.entries(s.rewards))  # fmt: skip
    return replace(s, **absolute)
