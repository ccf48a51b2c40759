"""The fine-tune's settings, declared once (jobs/config/settings.py): the command line gives back what it was given, every
stack key reaches the job under its setting's name, a value the job refuses is refused at preview naming its key,
and Pulumi.yaml's job keys are current and a valid Pulumi project file."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import yaml

from config.command_line import from_args, parse_args, to_argv
from config.settings import SETTINGS, FinetuneSettings, declared, stack_keys, value_type
from infra import PULUMI_YAML, ROOT
from infra.config.reader import key
from infra.config.stack import ConfigError
from tests.schemas import schema_file
from tests.stack_harness import parse_as_cli


def other_value(name: str):
    """A value of the setting other than its default, of its declared type."""
    d, kind, default = declared(SETTINGS[name]), value_type(name), SETTINGS[name].default
    if d.choices:
        return next(c for c in d.choices if c != default)
    if kind is bool:
        return not default
    if kind is int:
        return (default if default is not None else int(d.low or 0)) + 1
    if kind is float:
        return (default or 0.75) / 3  # a float whose shortest text is long: 6.666666666666667e-06
    return f"-{name} with a space=and,a comma"  # text a shell or argparse could split or take for a flag


def round_trip(s: FinetuneSettings) -> FinetuneSettings:
    return from_args(parse_args(to_argv(s)))


@pytest.mark.parametrize("name", SETTINGS)
def test_settings_to_argv_to_settings_is_the_identity(name):
    base = from_args(parse_args([]))
    changed = replace(base, **{name: other_value(name)})
    assert changed != base
    assert round_trip(changed) == changed


def test_every_setting_changed_at_once_comes_back():
    base = from_args(parse_args([]))
    changed = replace(base, **{name: other_value(name) for name in SETTINGS})
    assert round_trip(changed) == changed and round_trip(base) == base


# A value for each key the stack exposes that the stack accepts and that differs from the default.
STACK_VALUES = {
    "model": "org/other-model",
    "dataset": "org/other-data",
    "dataset_config": "en",
    "columns": "prompt=question,completion=answer",
    "split": "train[:512]",
    "eval_split": "none",
    "eval_tasks": "heldout,gsm8k",
    "objective": "dpo",
}
ALSO = {"objective": {"dataset": "org/pairs"}}  # the keys a value needs beside it


def stack_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("name", stack_keys())
def test_every_stack_key_reaches_the_job_under_its_settings_name(name):
    """Config key -> the settings the stack checks -> the job resource's command line -> the job's settings."""
    from infra.runner.ray_jobs import job_specs
    from infra.training import training_settings

    value = STACK_VALUES.get(name, other_value(name))
    also = {stack_keys()[n]: v for n, v in ALSO.get(name, {}).items()}
    cfg = parse_as_cli({stack_keys()[name]: stack_text(value)} | also)
    assert getattr(cfg.job, name) == value
    finetune = job_specs(training_settings(cfg), cfg.job.max_failures)[1]
    assert getattr(from_args(parse_args(list(finetune.args))), name) == value


def past_the_bounds(name: str) -> list:
    """Values just outside a number setting's declared bounds."""
    d, kind = declared(SETTINGS[name]), value_type(name)
    step = 1 if kind is int else 0.5
    found = []
    if d.low is not None:
        found.append(kind(d.low) if d.low_open else kind(d.low - step))
    if d.high is not None:
        found.append(kind(d.high) if d.high_open else kind(d.high + step))
    return found


BOUNDED = [(n, v) for n in stack_keys() for v in past_the_bounds(n)]


@pytest.mark.parametrize("name,value", BOUNDED, ids=[f"{n}={v}" for n, v in BOUNDED])
def test_a_value_past_a_declared_bound_is_refused_at_preview_naming_its_key(name, value):
    with pytest.raises(ConfigError) as err:
        parse_as_cli({stack_keys()[name]: str(value)})
    assert f"{key(stack_keys()[name])}: {value!r} must be" in str(err.value)


def test_the_job_refuses_the_same_values_naming_its_flags():
    from config.setting_checks import check
    from runtime.outcome import JobInputError

    with pytest.raises(JobInputError) as err:
        check(from_args(parse_args(["--warmup-ratio", "1.5", "--max-grad-norm", "-1", "--backend", "cpu"])))
    assert str(err.value) == "--warmup-ratio 1.5 must be below 1; --max-grad-norm -1.0 must be at least 0"


def test_eval_tasks_are_checked_against_lm_evals_own_index_at_preview():
    """A task name the installed lm-eval does not know, refused in the stack's words with the closest names;
    known names, heldout and none accepted; a malformed list named."""
    with pytest.raises(ConfigError) as err:
        parse_as_cli({"evalTasks": "heldout,gsm8k,hellaswg,arc_esay"})
    assert ("evalTasks: 'heldout,gsm8k,hellaswg,arc_esay' names tasks lm-eval 0.4.13 does not know: hellaswg "
            "(closest: hellaswag") in str(err.value) and "arc_esay (closest: arc_easy" in str(err.value)  # fmt: skip
    for accepted in ("heldout", "none", "heldout, arc_easy", "mmlu,gsm8k"):
        assert parse_as_cli({"evalTasks": accepted}).job.eval_tasks == accepted
    for bad, why in (("none,gsm8k", "give none alone"), ("heldout,,gsm8k", "is not a list of task names"),
                     ("held out", "not a task name")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            parse_as_cli({"evalTasks": bad})


def test_the_optimizer_takes_the_weight_decay_setting():
    from types import SimpleNamespace

    import torch

    from training.model import adamw

    s = replace(from_args(parse_args(["--backend", "cpu", "--num-workers", "1"])), weight_decay=0.05, lr=3e-4)
    group = adamw(SimpleNamespace(model=torch.nn.Linear(2, 2)), s).param_groups[0]
    assert (group["weight_decay"], float(group["lr"])) == (0.05, pytest.approx(3e-4))


# ---- Pulumi.yaml --------------------------------------------------------------------------------


def test_pulumi_yaml_job_keys_are_current():
    from infra.config import pulumi_yaml

    assert PULUMI_YAML.read_text() == pulumi_yaml.rendered(), "run: python -m infra.config.pulumi_yaml"
    assert pulumi_yaml.main(["--check"]) == 0


def test_pulumi_yaml_is_a_valid_project_file():
    import json

    import jsonschema

    project = yaml.safe_load(PULUMI_YAML.read_text())
    jsonschema.validate(project, json.loads(schema_file("pulumi project").read_text()))


# YAML 1.2's core schema (yaml.org/spec/1.2.2, 10.3.2), which the Pulumi CLI's Go parser follows: a plain scalar
# matching these is not a string. PyYAML follows YAML 1.1, where 2e-05 is one.
YAML_1_2_NOT_STRINGS = [r"null|Null|NULL|~|", r"true|True|TRUE|false|False|FALSE", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+",
                        r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.nan|\.NaN|\.NAN"]  # fmt: skip
PLAIN_TYPE = {"string": None, "integer": int, "boolean": bool}


def test_every_default_is_its_declared_type_as_the_cli_reads_it():
    """The CLI refuses a default whose type is not the key's: a string default that YAML 1.2 reads as a number (the
    learning rate's 2e-05) must be quoted."""
    root = yaml.compose(PULUMI_YAML.read_text())
    config = next(v for k, v in root.value if k.value == "config")
    wrong = []
    for name_node, decl in config.value:
        fields = {k.value: v for k, v in decl.value}
        if "default" not in fields:
            continue
        node, kind = fields["default"], fields["type"].value
        plain = node.style is None and any(re.fullmatch(p, node.value) for p in YAML_1_2_NOT_STRINGS)
        if kind == "string" and plain:
            wrong.append(f"{name_node.value}: {node.value} is not a string in YAML 1.2: quote it")
        elif kind != "string" and not isinstance(yaml.safe_load(node.value), PLAIN_TYPE[kind]):
            wrong.append(f"{name_node.value}: {node.value!r} is not {kind}")
    assert wrong == []


def test_the_learning_rates_default_is_written_once():
    """In the code (the docs and the tests aside): jobs/config/settings.py declares it; Pulumi.yaml is written from it."""
    code = [ROOT / "__main__.py", ROOT / "Makefile", *(p for d in ("jobs", "infra", "bench", ".ci")
                                                         for p in sorted((ROOT / d).rglob("*")) if p.is_file() and p.suffix != ".pyc")]  # fmt: skip
    found = [str(p.relative_to(ROOT)) for p in code if re.search(r"\b2e-0?5\b", p.read_text(errors="replace"))]
    assert found == ["jobs/config/settings.py"]
    assert yaml.safe_load(PULUMI_YAML.read_text())["config"]["learningRate"]["default"] == "2e-05"


def test_the_job_checks_every_number_and_names_tpu_flags_its_backend_ignores(capsys):
    from config.setting_checks import check
    from runtime.outcome import JobInputError

    with pytest.raises(JobInputError, match="--lr -0.001 must be greater than 0"):
        check(from_args(parse_args(["--lr=-1e-3", "--backend", "cpu", "--num-workers", "2"])))
    check(from_args(parse_args(["--backend", "cpu", "--num-workers", "2", "--topology", "2x2x2"])))
    assert capsys.readouterr().err == "warning: --topology 2x2x2: ignored with --backend cpu (TPU only)\n"
    check(from_args(parse_args(["--backend", "cpu", "--num-workers", "2"])))
    assert capsys.readouterr().err == ""
