"""The house rules a reader relies on: the runner never imports Pulumi, each job module is loaded once,
files and functions stay small, providers deployed before a move still load, and no link is dead."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "infra" / "runner"
ENTRY = ROOT / "jobs" / "ray_train_llm_finetune.py"
MAX_ENTRY_LINES = 400
MAX_FUNCTION_LINES = 60


def fresh_python(code: str) -> subprocess.CompletedProcess:
    """A new interpreter in the project directory, as Pulumi's hosts and `make local` start."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it, and every name it imports from one (`from X import Y`: X
    and X.Y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("path", sorted(RUNNER.glob("*.py")), ids=lambda p: p.name)
def test_the_runner_never_imports_pulumi(path):
    pulumi = {m for m in imported_modules(path) if m == "pulumi" or m.startswith(("pulumi.", "pulumi_"))}
    assert not pulumi, f"{path.relative_to(ROOT)} imports {sorted(pulumi)}: the runner is Pulumi-free"


def test_the_runner_loads_without_pulumi():
    modules = ", ".join(f"infra.runner.{p.stem}" for p in sorted(RUNNER.glob("*.py")) if p.stem != "__init__")
    done = fresh_python(f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith('pulumi')))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_each_job_module_is_loaded_once_under_one_name():
    """The stack and the jobs share the settings table, the TPU table and the memory plan: one module each, not
    `settings` and `jobs.settings` side by side (two tables)."""
    done = fresh_python(
        "import sys, infra.config.stack, infra.cloud.models, infra.prices, infra.training, ray_train_llm_finetune; "
        "from config import settings; from runtime import tpu_generations; import infra.cloud.tpu; "
        "print(sorted(m for m in sys.modules if m == 'jobs' or m.startswith('jobs.'))); "
        "print(infra.config.stack.settings is settings, infra.cloud.tpu.GENERATIONS is tpu_generations.GENERATIONS)"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "True True"]


def jobs_path_inserts(path: Path) -> list[str]:
    """Where a file puts jobs/ on sys.path."""
    text = path.read_text()
    return [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1)
            if re.search(r"sys\.path(\.insert|\.append|\[|\s*[+]?=)", line) and re.search("jobs", line, re.I)]  # fmt: skip


def test_one_door_makes_the_jobs_importable():
    """infra/, bench/ and the tests reach jobs/ through infra/job_modules.py, which a reader sees imported."""
    files = [p for d in ("infra", "bench", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    inserts = [place for path in files for place in jobs_path_inserts(path)]
    assert [p.split(":")[0] for p in inserts] == ["infra/job_modules.py"], inserts


def test_no_module_passes_400_lines():
    files = sorted((ROOT / "jobs").rglob("*.py")) + sorted((ROOT / "infra").rglob("*.py"))
    assert [f"{p.relative_to(ROOT)} ({n})" for p in files if (n := len(p.read_text().splitlines())) > 400] == []


def test_the_fine_tune_entry_holds_the_driver_and_the_loop_only():
    assert len(ENTRY.read_text().splitlines()) <= MAX_ENTRY_LINES


def long_functions(path: Path) -> list[str]:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [
        f"{shown}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_every_function_fits_on_a_screen():
    files = sorted((ROOT / "jobs").rglob("*.py")) + sorted((ROOT / "infra").rglob("*.py"))
    assert [f for path in files for f in long_functions(path)] == []


def test_the_length_rule_bites(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions(long) == [f"{long}:1 f ({MAX_FUNCTION_LINES + 1} lines)"]


# What a stack deployed before the runner moved holds in its state: its dynamic providers, pickled by
# reference as Pulumi's serialize_provider wrote them at commit 6245840 (infra/training.py and
# infra/crd_wait.py have not moved, and must not), and the served evaluation's as written at f26544a, before
# infra/ became packages (infra/served_evaluation.py stayed at infra/'s top for it).
DEPLOYED_PROVIDERS = {
    "_TrainingJobsProvider": "gASVLwAAAAAAAACMDmluZnJhLnRyYWluaW5nlIwVX1RyYWluaW5nSm9ic1Byb3ZpZGVylJOUKYGULg==",
    "_CrdEstablishedProvider": "gASVMQAAAAAAAACMDmluZnJhLmNyZF93YWl0lIwXX0NyZEVzdGFibGlzaGVkUHJvdmlkZXKUk5QpgZQu",
    "_ServedEvaluationProvider": "gASVPAAAAAAAAACMF2luZnJhLnNlcnZlZF9ldmFsdWF0aW9ulIwZX1NlcnZlZEV2YWx1YXRpb25Qcm92aWRlcpSTlCmBlC4=",
}


@pytest.mark.parametrize("name", DEPLOYED_PROVIDERS)
def test_a_stack_deployed_before_the_move_can_still_be_refreshed_and_destroyed(name):
    """Pulumi's provider host (`python -m pulumi.dynamic`, the working directory first on sys.path) loads the
    stored provider, and its diff and delete are there to call."""
    load = (
        "import sys; sys.path.insert(0, ''); import base64, dill; "
        f"p = dill.loads(base64.b64decode({DEPLOYED_PROVIDERS[name]!r})); "
        "d = p.diff('id', {'a': 1}, {'a': 1}); "
        "print(type(p).__name__, callable(p.delete), type(d).__name__, bool(d.changes))"
    )
    done = fresh_python(load)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [name, "True", "DiffResult", "False"]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def dead_links(page: Path) -> list[str]:
    dead = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL, checked by nobody here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{page.name}: {target} (no {path})")
        elif anchor and file.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
            if anchor not in headings:
                dead.append(f"{page.name}: {target} (no heading #{anchor})")
    return dead


def test_every_relative_link_in_the_readme_and_the_manual_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 5
    assert [d for page in pages for d in dead_links(page)] == []


def test_a_dead_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](#top) [gone](missing.md) [anchor](page.md#nowhere) [web](https://example.com)\n")
    assert dead_links(page) == ["page.md: missing.md (no missing.md)", "page.md: page.md#nowhere (no heading #nowhere)"]


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for command in ("make local", "make test", "pulumi up -s v6e"):
        assert command in readme


def test_every_component_takes_a_name_typed_args_and_options():
    """As pulumi-eks's components: (name, args, opts), the args a dataclass built by keyword, dependencies and
    providers through opts."""
    import dataclasses
    import importlib
    import inspect
    import typing

    import pulumi

    components = []
    for path in sorted((ROOT / "infra").rglob("*.py")):
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        components += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__
                       and issubclass(c, pulumi.ComponentResource)]  # fmt: skip
    assert len(components) >= 7
    for component in components:
        hints = typing.get_type_hints(component.__init__)
        assert list(inspect.signature(component.__init__).parameters) == ["self", "name", "args", "opts"], component
        args = hints["args"]
        keyword_only = all(f.kw_only for f in dataclasses.fields(args))
        assert dataclasses.is_dataclass(args) and keyword_only, (component, args)


def test_every_torch_tpu_name_is_called_from_one_module_that_says_where_it_read_it():
    """torch-tpu cannot run here: each name the jobs call is listed with the wheel's file it was read in."""
    import importlib

    import infra.job_modules  # noqa: F401  (the one door: jobs/ on the path)

    torch_tpu_api = importlib.import_module("runtime.torch_tpu_api")

    api = ROOT / "jobs" / "runtime" / "torch_tpu_api.py"
    others = [p for p in (ROOT / "jobs").rglob("*.py") if p != api] + list(ROOT.glob("infra/**/*.py"))
    assert [p.name for p in others if any(m.split(".")[0] == "torch_tpu" for m in imported_modules(p))] == []
    called = {m for m in imported_modules(api) if m.split(".")[0] == "torch_tpu"}
    called -= {m.rsplit(".", 1)[0] for m in called if m.count(".") > 1}  # a `from X import Y`'s X
    source = api.read_text()
    assert called <= set(torch_tpu_api.READ_IN) and all(name.rsplit(".", 1)[-1] in source.split("READ_IN")[-1]
                                                        for name in torch_tpu_api.READ_IN)  # fmt: skip


def test_the_suites_slowest_files_are_files_it_has():
    """conftest.SLOWEST_FIRST orders `make test`'s files: a renamed file would fall silently to the end."""
    from tests.conftest import SLOWEST_FIRST

    here = Path(__file__).parent
    assert [name for name in SLOWEST_FIRST if not (here / name).is_file()] == []
