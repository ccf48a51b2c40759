"""The settings' checks: every value the job refuses, before anything is loaded (`problems`: each setting's type,
choices and bounds as settings.py declares them, then the rules between settings), the workers and slices, and
`check`, which the job runs before Ray and the stack (through `problems`) at preview."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import asdict, dataclass

from config import eval_tasks, reward_specs
from config.data_formats import DEFAULT_DATASET, parse_columns
from config.declared import value_problem
from config.settings import PLACEMENT, SETTINGS, FinetuneSettings, flag, named
from config.splits import EXAMPLES, eval_split_problem, is_split
from runtime.outcome import JobInputError
from runtime.tpu_generations import by_accelerator_type, chips_of, is_topology


@dataclass(frozen=True)
class Problem:
    """A setting's value the job refuses. `message` reads after the value ("must be ..."); a setting it names is
    written {name}, which the job renders as its flag and the stack as its config key."""

    name: str
    value: object
    message: str

    def render(self, name_of) -> str:
        return named(self.message, name_of)

    def for_job(self) -> str:
        return f"{flag(self.name)} {self.value!r} {self.render(flag)}"


def _declared_problem(name: str, value) -> str | None:
    return value_problem(SETTINGS[name], value)


def problems(s: FinetuneSettings) -> list[Problem]:
    """Every value the job refuses, before anything is loaded: each setting's type, choices and bounds, then the
    rules between settings. The stack runs this at preview on the settings it will send."""
    found = [Problem(n, v, m) for n, v in asdict(s).items() if (m := _declared_problem(n, v))]
    if found:  # the rules below assume each value is sound
        return found
    if s.columns:
        try:
            parse_columns(s.columns)
        except JobInputError as err:
            found.append(Problem("columns", s.columns, f"is not NEW=OLD pairs: {str(err).split(': ', 1)[-1]}"))
    if s.dataset_config is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", s.dataset_config):
        found.append(Problem("dataset_config", s.dataset_config, "is not a configuration name such as 'en'"))
    if s.objective == "dpo" and s.dataset == DEFAULT_DATASET:
        found.append(Problem("dataset", s.dataset, "holds instructions, not preference pairs: {objective} dpo needs "
                             "records with prompt, chosen and rejected (or chosen and rejected alone), such as the "
                             "hub's trl-lib/ultrafeedback_binarized or a file of your own"))  # fmt: skip
    if s.objective == "grpo":
        found += grpo_problems(s)
    if why := eval_tasks.problem(s.eval_tasks):
        found.append(Problem("eval_tasks", s.eval_tasks, why))
    if not is_split(s.split):
        found.append(Problem("split", s.split, f"is not a split expression such as {EXAMPLES}"))
    elif why := eval_split_problem(s.eval_split, s.split):
        found.append(Problem("eval_split", s.eval_split, why))
    if s.save_every and not s.sharded_checkpoints:
        found.append(Problem("save_every", s.save_every, "needs {sharded_checkpoints} (a full checkpoint restores the "
                             "weights only, so a run could not go on from the middle of an epoch): set it to 0, or "
                             "use sharded checkpoints"))  # fmt: skip
    return found + placement_problems(s)


def grpo_problems(s: FinetuneSettings) -> list[Problem]:
    """GRPO's rules: prompt records, whole groups in each rank's batch, rewards that can be loaded."""
    found = []
    if s.dataset == DEFAULT_DATASET:
        found.append(Problem("dataset", s.dataset, "holds instructions, not prompts with checkable answers: "
                             "{objective} grpo needs records with a prompt (text or turns) and the columns its "
                             "rewards read, e.g. answer, such as the hub's openai/gsm8k with {columns} "
                             "prompt=question or a file of your own"))  # fmt: skip
    if s.batch_size % s.num_generations:
        fits = s.batch_size // s.num_generations * s.num_generations or s.num_generations
        found.append(Problem("batch_size", s.batch_size, f"does not hold whole groups of {{num_generations}} "
                             f"{s.num_generations} completions (a group is one prompt's, compared with each other "
                             f"on one rank): give {fits} or another multiple of {s.num_generations}, or a "
                             f"{{num_generations}} that divides {s.batch_size}"))  # fmt: skip
    if s.epsilon_high is not None and s.epsilon_high < s.epsilon:
        found.append(Problem("epsilon_high", s.epsilon_high, f"is below {{epsilon}} {s.epsilon}: the clip above "
                             "1 is at least the one below (DAPO's clip-higher raises it)"))  # fmt: skip
    if bad := reward_specs.problem(s.rewards, s.reward_weights):
        name, why = bad
        found.append(Problem(name, getattr(s, name), why))
    return found


def placement_problems(s: FinetuneSettings) -> list[Problem]:
    """The workers and slices: on TPU the slices decide the workers (a given --num-workers must agree); elsewhere
    --num-workers does, and --num-slices divides it."""
    if not is_topology(s.topology):  # whatever the backend: a typo is refused, not silently ignored
        return [Problem("topology", s.topology, "is not a topology such as 4x4 or 2x2x2")]
    if s.backend == "tpu":
        generation = by_accelerator_type(s.accelerator_type)
        if s.topology not in generation.topologies:  # Ray Train would retry its placement forever
            return [Problem("topology", s.topology, f"is not a {generation.name} multi-host topology; allowed for "
                            f"{{accelerator_type}} {s.accelerator_type}: {', '.join(generation.topologies)}")]  # fmt: skip
        per_slice = chips_of(s.topology) * generation.devices_per_chip
        devices = per_slice * s.num_slices
        if s.num_workers is not None and s.num_workers != devices:
            what = f"{{topology}} {s.topology} on {s.accelerator_type}, which has {devices} devices"
            if s.num_slices > 1:
                what = (f"{{num_slices}} {s.num_slices} x {{topology}} {s.topology} on {s.accelerator_type} "
                        f"({per_slice} devices a slice, {devices} in all)")  # fmt: skip
            return [Problem("num_workers", s.num_workers, f"does not match {what}; drop {{num_workers}} or give "
                            f"{devices}")]  # fmt: skip
        return []
    if s.num_workers is None:
        return [Problem("num_workers", None, f"must be given with {{backend}} {s.backend}: how many workers")]
    if s.num_workers % s.num_slices:
        divisors = ", ".join(str(n) for n in range(1, s.num_workers + 1) if s.num_workers % n == 0)
        return [Problem("num_slices", s.num_slices, f"does not divide {{num_workers}} {s.num_workers}: every slice "
                        f"holds as many workers as the others; give one of {divisors}")]  # fmt: skip
    return []


def ignored(s: FinetuneSettings) -> list[str]:
    """The TPU placement settings given other values than their defaults where the backend is not tpu: the run
    ignores them (the caller says so)."""
    if s.backend == "tpu":
        return []
    return [name for name in ("topology", "accelerator_type") if getattr(s, name) != SETTINGS[name].default]


def placement(args: argparse.Namespace) -> FinetuneSettings:
    """The placement settings of `args` (the collectives check's), checked as the fine-tune's are."""
    s = FinetuneSettings(**{name: getattr(args, name) for name in PLACEMENT})
    found = [Problem(n, v, m) for n in PLACEMENT if (m := _declared_problem(n, v := getattr(s, n)))]
    return _checked(s, found or placement_problems(s))


def check(s: FinetuneSettings) -> FinetuneSettings:
    """`s`, or JobInputError naming every refused value with its flag; a flag the backend ignores is named on
    stderr."""
    return _checked(s, problems(s))


def _checked(s: FinetuneSettings, found: list[Problem]) -> FinetuneSettings:
    if found:
        raise JobInputError("; ".join(p.for_job() for p in found))
    if names := ignored(s):
        given = ", ".join(f"{flag(n)} {getattr(s, n)}" for n in names)
        print(f"warning: {given}: ignored with --backend {s.backend} (TPU only)", file=sys.stderr)
    return s


def worker_count(s: FinetuneSettings) -> int:
    """Ray Train's workers: one per device of the slices on TPU, else --num-workers (checked settings)."""
    if s.backend != "tpu":
        return s.num_workers
    return chips_of(s.topology) * by_accelerator_type(s.accelerator_type).devices_per_chip * s.num_slices
