"""jobs/ as packages, one way down: each package imports only the packages below it, no module imports itself
back through others, the top of jobs/ holds the entry points, and each package says what it holds."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
ORDER = ("runtime", "config", "data", "training", "evaluation")  # bottom first; the entry scripts stand above all
ENTRY_POINTS = {"ray_core_collectives", "ray_train_llm_finetune", "rescore", "tiny_assets"}
MAX_TOP_MODULES = 10
# infra/'s floors, bottom first: its packages and the modules at its top (the door to jobs/; the dynamic resources,
# which stay where deployed stacks pickled them; the prices, which read the config and the components; make local).
INFRA_ORDER = ("job_modules", "runner", "crd_wait", "cloud", "serving", "config", "resources", "prices", "training",
               "served_evaluation", "local_run")  # fmt: skip


def modules_under(root: Path) -> dict[str, Path]:
    """Every module below root by its dotted name as imported with root on sys.path (a package by its name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The known modules a file imports, at its top or inside a function: `from a import b` is a.b where a.b
    is a module, else a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        found |= {name for name in names if name in known}
    return found


def import_graph(root: Path, prefix: str = "") -> dict[str, set[str]]:
    modules = {prefix + name: path for name, path in modules_under(root).items()}
    return {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def rank(module: str, order: tuple[str, ...]) -> int:
    """A module's floor: its package's place in order; a top-level script stands above every package."""
    package = module.split(".")[0]
    return order.index(package) if package in order else len(order)


def upward_imports(root: Path, order: tuple[str, ...], prefix: str = "") -> list[str]:
    """Each import of a module in a higher package (or of an entry script) by a module in a package; with a
    prefix (infra's modules import each other as `infra.x`), the names below it."""
    graph = {m.removeprefix(prefix): {i.removeprefix(prefix) for i in imports}
             for m, imports in import_graph(root, prefix).items() if m.startswith(prefix)}  # fmt: skip
    return [f"{m} imports {i} ({i.split('.')[0]} is above {m.split('.')[0]})"
            for m in sorted(graph) if "." in m or m in order
            for i in sorted(graph[m]) if rank(i, order) > rank(m, order)]  # fmt: skip


def test_no_import_circle_in_jobs_infra_or_bench():
    graph = import_graph(JOBS)
    for part in ("infra", "bench"):
        graph |= import_graph(ROOT / part, prefix=f"{part}.")
    assert len(graph) > 60
    assert circles(graph) == []


def test_each_package_of_jobs_imports_only_the_packages_below_it():
    assert upward_imports(JOBS, ORDER) == []


def test_each_floor_of_infra_imports_only_the_floors_below_it():
    assert upward_imports(ROOT / "infra", INFRA_ORDER, prefix="infra.") == []


def test_the_top_of_infra_holds_at_most_ten_modules_each_a_floor():
    top = {p.stem for p in (ROOT / "infra").glob("*.py")} - {"__init__"}
    packages = {p.parent.name for p in (ROOT / "infra").glob("*/__init__.py")}
    assert len(top) <= MAX_TOP_MODULES and top | packages == set(INFRA_ORDER)


def test_a_lower_package_importing_a_higher_one_is_found_and_so_is_a_circle(tmp_path):
    for package in ("runtime", "training"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "runtime" / "clock.py").write_text("def now():\n    from training import loop\n\n    return loop\n")
    (tmp_path / "training" / "loop.py").write_text("from runtime.clock import now\n")
    assert upward_imports(tmp_path, ("runtime", "training")) == [
        "runtime.clock imports training.loop (training is above runtime)"
    ]
    assert circles(import_graph(tmp_path)) == [["runtime.clock", "training.loop"]]
    (tmp_path / "runtime" / "clock.py").write_text("import time\n")
    assert upward_imports(tmp_path, ("runtime", "training")) == [] and circles(import_graph(tmp_path)) == []


def test_the_top_of_jobs_holds_the_entry_points_and_each_package_says_what_it_holds():
    top = {p.stem for p in JOBS.glob("*.py")}
    assert top == ENTRY_POINTS and len(top) <= MAX_TOP_MODULES
    packages = sorted(p.parent for p in JOBS.glob("*/__init__.py"))
    assert [p.name for p in packages] == sorted(ORDER)
    assert [d.name for d in JOBS.iterdir() if d.is_dir() and d.name != "__pycache__" and d not in packages] == []
    infra_packages = sorted(p.parent for p in (ROOT / "infra").glob("*/__init__.py"))
    for package in packages + infra_packages:
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert docstring and len(docstring.splitlines()) >= 3, f"{package.relative_to(ROOT)}/__init__.py"


def test_every_module_the_ranks_fork_server_preloads_is_there():
    """multiprocessing's fork server skips a preload name that does not import without a word (forkserver.py
    `main`), so a module moved or renamed leaves each rank importing it again (seconds of CPU a rank)."""
    from importlib.util import find_spec

    from tests.inprocess import FORKSERVER_PRELOAD

    assert [name for name in FORKSERVER_PRELOAD if find_spec(name) is None] == []
