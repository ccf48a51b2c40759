"""How a setting of the fine-tune is declared: a dataclass field whose metadata holds its help, stack key, flag
aliases, bounds or choices, and recipes (settings.py declares every one of them this way)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Declared:
    """What `setting` records about a field besides its type and default."""

    help: str
    key: str | None = None  # the stack's config key; None: not exposed
    aliases: tuple[str, ...] = ()  # the walkthrough's flag names
    choices: tuple | None = None
    low: float | None = None  # the least value allowed ...
    low_open: bool = False  # ... itself excluded
    high: float | None = None  # the most allowed (inclusive) ...
    high_open: bool = False  # ... itself excluded
    high_why: str = ""  # why nothing past `high` can be what a user meant
    recipes: dict | None = None  # {recipe: value} for a setting --recipe decides
    stack_default: bool = True  # Pulumi.yaml declares the default (False: it depends on another key)


def setting(default, help: str, **declared):
    """A field of FinetuneSettings and its declaration. A recipe's setting defaults to the default recipe's."""
    recipes = declared.get("recipes")
    value = recipes["default"] if recipes else default
    return field(default=value, metadata={"declared": Declared(help, **declared)})


def declared(f) -> Declared:
    """A settings field's declaration."""
    return f.metadata["declared"]


def number(x: float) -> str:
    """A bound as a person reads it: 10,000,000 rather than 1e+07."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def value_problem(f, value) -> str | None:
    """What is wrong with `value` for the settings field `f` by its own declaration (type aside): set where it
    must be, one of its choices, finite, within its bounds; None when nothing is."""
    d = declared(f)
    if value is None:
        return None if f.default is None and not d.recipes else "must be set"
    if d.choices and value not in d.choices:
        return f"is not one of {', '.join(map(str, d.choices))}"
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if d.low is not None and (value < d.low or (d.low_open and value == d.low)):
        return f"must be {'greater than' if d.low_open else 'at least'} {number(d.low)}"
    if d.high is not None and (value > d.high or (d.high_open and value == d.high)):
        why = f" ({d.high_why})" if d.high_why else ""
        return f"must be {'below' if d.high_open else 'at most'} {number(d.high)}{why}"
    return None
