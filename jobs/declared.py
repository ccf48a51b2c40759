"""How a setting of the fine-tune is declared: a dataclass field whose metadata holds its help, stack key, flag
aliases, bounds or choices, and recipes (settings.py declares every one of them this way)."""

from __future__ import annotations

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
