"""One-way layering (autopar/layers.py, docs/architecture.md), checked on the source with `ast`.

Every import statement of autopar/, envs/ and policies/ counts, module level or inside a function,
relative ones resolved; `if TYPE_CHECKING:` blocks never run and are left out. A project import
inside a function is allowed only where its target pulls a heavy optional package (torch, ...) at
import time, and says so in a comment."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

from autopar.layers import LAYERS, LAZY_PACKAGES, layer_of, unit_of

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (("autopar", "autopar"), ("envs", "autopar.envs"), ("policies", "autopar.policies"))
MAX_FUNCTION_LEVEL = 30  # project imports inside functions (each one pulls torch or another heavy package)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module or package (a project module when it is one)
    in_function: bool
    line: int
    commented: bool  # a `#` comment on the statement's lines


def find_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package __init__)} of every module under the three source folders."""
    out = {}
    for folder, package in SOURCES:
        for f in sorted((root / folder).rglob("*.py")):
            parts = list(f.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join([package] + parts[:-1] if is_package else [package] + parts)] = (f, is_package)
    return out


def _targets(node, module: str, is_package: bool, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def find_imports(modules) -> list[Import]:
    imports = []
    for module, (path, is_package) in modules.items():
        source = path.read_text()
        lines = source.splitlines()

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    commented = any("#" in line for line in lines[child.lineno - 1:child.end_lineno])
                    for target in _targets(child, module, is_package, modules):
                        imports.append(Import(module, target, in_function, child.lineno, commented))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(source, str(path)), False)
    return imports


def project_module(target: str, modules) -> str | None:
    """The project module an import target names (a name imported from a package: the package)."""
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in modules else None


def edges(imports, modules) -> set[tuple[str, str]]:
    return {(i.module, t) for i in imports if (t := project_module(i.target, modules)) and t != i.module}


def upward(imports, modules) -> list[str]:
    return sorted({f"{i.module}:{i.line} imports {t} ({LAYERS[layer_of(i.module)][0]} -> {LAYERS[layer_of(t)][0]})"
                  for i in imports if (t := project_module(i.target, modules))
                  and layer_of(t) > layer_of(i.module)})


def cycles(pairs) -> list[list[str]]:
    graph = nx.DiGraph((a, b) for a, b in pairs if a != b)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def heavy_modules(imports, modules) -> set[str]:
    """Project modules that import a LAZY_PACKAGES package when imported (module level, transitively,
    parent packages included: importing a.b runs a/__init__.py)."""
    graph = nx.DiGraph()
    heavy = set()
    for i in imports:
        if i.in_function:
            continue
        if (t := project_module(i.target, modules)) is not None:
            graph.add_edge(i.module, t)
        elif i.target.split(".")[0] in LAZY_PACKAGES:
            heavy.add(i.module)
    for module in modules:
        parts = module.split(".")
        graph.add_edges_from((module, ".".join(parts[:n])) for n in range(1, len(parts)) if ".".join(parts[:n]) in modules)
    return {m for m in modules if m in heavy or (m in graph and nx.descendants(graph, m) & heavy)}


def misplaced_lazy_imports(imports, modules) -> list[str]:
    """Function-level imports that are not of a heavy package (or a module that pulls one), or lack
    the comment saying why."""
    heavy = heavy_modules(imports, modules)
    bad = []
    for i in imports:
        if not i.in_function:
            continue
        t = project_module(i.target, modules)
        lazy = t in heavy if t else i.target.split(".")[0] in LAZY_PACKAGES
        if not lazy or not i.commented:
            bad.append(f"{i.module}:{i.line} {i.target}" + ("" if lazy else " (not heavy: import it at module level)")
                       + ("" if i.commented else " (no comment saying why it is inside a function)"))
    return sorted(set(bad))


MODULES = find_modules(ROOT)
IMPORTS = find_imports(MODULES)


def test_every_module_has_a_layer():
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert unplaced == [], f"place these in autopar/layers.py: {unplaced}"


def test_no_import_goes_up_a_layer():
    assert upward(IMPORTS, MODULES) == []


def test_no_import_cycle_among_modules():
    assert cycles(edges(IMPORTS, MODULES)) == []


def test_no_import_cycle_among_packages():
    assert cycles({(unit_of(a), unit_of(b)) for a, b in edges(IMPORTS, MODULES)}) == []


def test_imports_inside_functions_are_only_heavy_ones_and_say_so():
    inner = sorted({(i.module, i.line) for i in IMPORTS if i.in_function and project_module(i.target, MODULES)})
    print(f"function-level project imports: {len(inner)} (bound {MAX_FUNCTION_LEVEL})")
    assert misplaced_lazy_imports(IMPORTS, MODULES) == []
    assert len(inner) <= MAX_FUNCTION_LEVEL


@pytest.mark.slow
def test_the_plan_contract_and_the_command_line_load_without_torch():
    """The layering's point in practice: reading a plan, or `autopar --help`, imports neither torch
    nor the planners' optional packages."""
    code = ("import sys, autopar.plan, autopar.cluster, autopar.cli; autopar.cli.build_parser(); "
            f"print(sorted(m for m in {LAZY_PACKAGES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# -- the checker itself, on a made-up tree: it must see what it claims to ---------------------------------

def _tree(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder, _ in SOURCES:
        (tmp_path / folder).mkdir(exist_ok=True)
    modules = find_modules(tmp_path)
    return modules, find_imports(modules)


def test_the_checker_finds_an_upward_import_inside_a_function_and_a_relative_cycle(tmp_path):
    modules, imports = _tree(tmp_path, {
        "autopar/__init__.py": "",
        "autopar/cost/__init__.py": "",
        "autopar/cost/model.py": "def f():\n    from autopar.search.space import walk\n",
        "autopar/search/__init__.py": "",
        "autopar/search/space.py": "from ..cost import model\nwalk = 1\n",
        "autopar/plan.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autopar.cost import model\n",
    })
    assert upward(imports, modules) == ["autopar.cost.model:2 imports autopar.search.space (cost -> search)"]
    assert cycles(edges(imports, modules)) == [["autopar.cost.model", "autopar.search.space"]]
    assert ("autopar.plan", "autopar.cost.model") not in edges(imports, modules)  # TYPE_CHECKING never runs
    assert misplaced_lazy_imports(imports, modules) == [
        "autopar.cost.model:2 autopar.search.space (not heavy: import it at module level)"
        " (no comment saying why it is inside a function)"]


def test_the_checker_allows_a_commented_lazy_import_of_a_module_that_pulls_torch(tmp_path):
    modules, imports = _tree(tmp_path, {
        "autopar/__init__.py": "",
        "autopar/executor/__init__.py": "",
        "autopar/executor/train_step.py": "import torch\n",
        "autopar/cli/__init__.py": "",
        "autopar/cli/run.py": "def run():\n    from autopar.executor.train_step import apply  # torch\n",
    })
    assert misplaced_lazy_imports(imports, modules) == []
    assert upward(imports, modules) == [] and cycles(edges(imports, modules)) == []


@pytest.mark.parametrize("module, layer", [("autopar.plan", "contract"), ("autopar.cluster.io", "contract"),
                                           ("autopar.policies.planner", "rl"), ("autopar", "cli")])
def test_layer_table(module, layer):
    assert LAYERS[layer_of(module)][0] == layer
