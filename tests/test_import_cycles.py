"""The package's modules import one another without a cycle: each layer imports only the ones below it.

The graph is read from the source with ``ast`` (nothing is imported), and it counts every import: at module
level, under ``TYPE_CHECKING`` and inside functions. A type-only or deferred import hides a cycle from
Python but not from the reader: it still says that the two modules need each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import chattts_serve

PACKAGE = Path(chattts_serve.__file__).parent


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (``from pkg import submodule`` names the submodule;
    ``from pkg import name`` names ``pkg``, whose ``__init__`` runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_through_a_type_only_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import thing\n"
    )
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("import pkg.sub\n")
    assert find_cycle(import_graph(pkg)) is None
