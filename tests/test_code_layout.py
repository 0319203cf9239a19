"""The package's shape, as docs/architecture.md states it: no two of its files import each other
(directly or around a circle), no module imports another's private name, and the test tree
mirrors the package tree. Read from the sources with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "shared": "kvserve.shared",
    "services": "kvserve.services",
    "kernels": "kvserve.kernels",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def sources() -> dict[str, ast.Module]:
    return {
        module_name(p): ast.parse(p.read_text(), str(p))
        for top in PACKAGES
        for p in sorted((ROOT / top).rglob("*.py"))
    }


def imported(tree: ast.Module) -> Iterator[tuple[str, str | None]]:
    """(module, name) for every `from kvserve... import name` and `import kvserve...`,
    anywhere in the file (a function-level or TYPE_CHECKING import is an import too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvserve"):
            for alias in node.names:
                yield str(node.module), alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvserve"):
                    yield alias.name, None


def import_graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, tree in mods.items():
        deps = set()
        for module, attr in imported(tree):
            target = f"{module}.{attr}" if attr and f"{module}.{attr}" in mods else module
            if target in mods and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_two_files_import_each_other() -> None:
    assert cycles(import_graph(sources())) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_modules() -> None:
    found = [
        f"{name}: {module}.{attr}"
        for name, tree in sources().items()
        for module, attr in imported(tree)
        if attr and attr.startswith("_") and not attr.startswith("__")
    ]
    assert found == []


@pytest.mark.parametrize("top", ["shared", "services"])
def test_the_test_tree_mirrors_the_package_tree(top: str) -> None:
    """Every folder of tests under tests/<top> is a folder of the package."""
    folders = {p.parent for p in (ROOT / "tests" / top).rglob("test_*.py")}
    missing = [
        str(f.relative_to(ROOT))
        for f in folders
        if not (ROOT / f.relative_to(ROOT / "tests")).is_dir()
    ]
    assert missing == []
