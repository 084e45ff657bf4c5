"""The shape of the code, read from the source with ``ast``: an acyclic module graph inside ``lean/`` (counting the
imports made for annotations only), configuration at the bottom of it, GRPO's objective written in one file, long
functions documented, and every schedule, model family and dtype name spelled as a literal in exactly one module (its
registry), as is each family's pipeline class (its spec)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lean.config.dtypes import DTYPES
from lean.models import FAMILIES
from lean.schedules import AUTO, SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lean"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(
    tree: ast.Module, name: str, is_package: bool, modules: set[str], annotations: bool = False
) -> set[str]:
    """The modules a module imports when it runs (``if TYPE_CHECKING:`` blocks are annotations only; with
    ``annotations``, those too). ``from package import submodule`` depends on the submodule (a package's own
    ``__init__`` always runs first)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def module_graph(annotations: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        imports = runtime_imports(tree, name, path.name == "__init__.py", set(files), annotations)
        graph[name] = {m for m in imports if m in files and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


@pytest.mark.parametrize("annotations", [False, True], ids=["runtime", "with-type-checking"])
def test_the_module_graph_is_acyclic(annotations):
    graph = module_graph(annotations)
    assert len(graph) > 30 and "lean.run.iteration" in graph["lean.train"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# What the config package's modules may import from lean: each other (the mechanism, the run-level sections, the
# registry and the leaf modules). The domain modules declare and register their sections and own their cross-section
# rules (lean.configure).
MECHANISM = ("checks", "sections", "read", "moved", "plugins")  # lean/config/<name>.py; __init__ re-exports them
MECHANISM_LINES = 300  # the mechanism's code lines (docstrings, comments and blank lines not counted)


def code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: not blank, not a comment, not inside a docstring."""
    tree = ast.parse(path.read_text())
    doc = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = path.read_text().splitlines()
    return sum(
        1 for i, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#") and i not in doc
    )


def test_configuration_is_at_the_bottom():
    graph = module_graph(annotations=True)
    config = {m for m in graph if m == "lean.config" or m.startswith("lean.config.")}
    for module in config:
        assert graph[module] <= config, f"{module} imports {graph[module] - config}"
    importers = [m for m, deps in graph.items() if "lean.config" in deps]
    assert len(importers) > 10  # the sections are read everywhere; config reads nothing back


def test_the_mechanism_is_small():
    """The mechanism (errors and checks, the section registry, reading, moved keys, plugins) is small; the sections
    live with their owners (lean.config.run_sections holds the run-level ones)."""
    total = sum(code_lines(PACKAGE / "config" / f"{name}.py") for name in MECHANISM)
    assert total < MECHANISM_LINES, total


# lean's packages (and root modules) from the bottom up: a module imports only from its own layer and the ones below.
LAYERS = (
    {"config"},  # the mechanism, the registries, dtypes, prompts, presets: no domain module
    {"observe"},  # timers, FLOPs, memory, tracking, provenance, files
    {"parallel"},  # processes, sharding, layout, FlashOverlap
    {"sampling"},  # the SDE and the sampling loop
    {"models", "rewards"},  # the families; what scores a sample
    {"algorithms"},  # what is optimised
    {"schedules"},  # how its gradient is computed
    {"configure"},  # load_config: the sections, then their owners' rules
    {"run"},  # one iteration, the optimizer step, the scoring worker
    {"plan", "evaluation", "checkpoint", "export"},
    {"train"},  # lean train's loop
    {"tools"},  # the certificate, benchmarks, lean sample, lean ui
    {"workbench"},  # the DVC workbench's logic
    {"cli"},
)
ROOT_MODULES_AT_MOST = 10


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    if top == "__init__":
        return -1  # lean/__init__.py: the version, imports nothing
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_packages_are_layered():
    """A lower package never imports a higher one (every module of lean/ is placed in LAYERS)."""
    graph = module_graph(annotations=True)
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) > layer(m)]
    assert not upward, upward


def test_few_modules_at_the_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, root


LOSS_TERMS = {"clipped_surrogate", "kl_penalty", "kl_step_weights", "group_advantages"}


def test_grpo_is_written_in_one_file():
    """The clipped surrogate, the KL and the advantages are defined in lean/algorithms only (grpo.py, groups.py);
    the schedules and the certificate reach them through the algorithm (test_schedules checks the calls)."""
    defined = {
        (str(path.relative_to(ROOT)), node.name)
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name in LOSS_TERMS | {"step_loss", "reference_loss"}
    }
    outside = {(f, n) for f, n in defined if not f.startswith("lean/algorithms/")}
    assert not outside, outside
    assert ("lean/algorithms/grpo.py", "clipped_surrogate") in defined
    assert ("lean/algorithms/grpo.py", "step_loss") in defined and (
        "lean/algorithms/grpo.py",
        "reference_loss",
    ) in defined


MAX_FUNCTION_LINES = 60  # the def to its last line, docstring included
MAX_PARAMETERS = 8  # positional, keyword-only, *args and **kwargs; self and cls not counted


def functions():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node


def parameter_count(node: ast.FunctionDef) -> int:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return len([n for n in names if n.arg not in ("self", "cls")])


def test_functions_are_short_and_take_few_parameters():
    """A growing feature grows a record, not every signature on the way; a function reads in one screen."""
    long = [
        f"{where} ({n.end_lineno - n.lineno + 1} lines)"
        for where, n in functions()
        if n.end_lineno - n.lineno >= MAX_FUNCTION_LINES
    ]
    wide = [
        f"{where} ({parameter_count(n)} parameters)" for where, n in functions() if parameter_count(n) > MAX_PARAMETERS
    ]
    assert not long and not wide, long + wide


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def string_literals(path: Path) -> set[str]:
    """Every string constant of a module except docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    }


SOURCES = [*PACKAGE.rglob("*.py"), *(ROOT / "pipelines").glob("*.py"), *(ROOT / "notebooks").glob("*.py")]


# a family's diffusers pipeline class is a fact of its spec (lean/models/<family>/spec.py), spelled nowhere else
PIPELINES = sorted({spec.pipeline for spec in FAMILIES.values()})


@pytest.mark.parametrize(
    "kind,names",
    [
        ("schedule", [*SCHEDULES, AUTO]),
        ("model family", list(FAMILIES)),
        ("dtype", list(DTYPES)),
        ("pipeline class", PIPELINES),
    ],
)
def test_names_are_spelled_in_one_module(kind, names):
    literals = {path: string_literals(path) for path in SOURCES}
    for name in names:
        spelled = sorted(str(p.relative_to(ROOT)) for p, found in literals.items() if name in found)
        assert len(spelled) == 1, f"the {kind} {name!r} is spelled in {spelled}"
