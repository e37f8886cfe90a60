"""The house's rules, read from the source: no import circle anywhere in `src/` (imports
under TYPE_CHECKING count: a circle of types is a circle of concepts), and no folder of more
than 15 modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ringplug"
MOST_MODULES_A_FOLDER = 15


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of this package that `path` imports, by name: `from pkg import mod` counts
    as an import of `pkg.mod`, `from pkg import name` as one of `pkg`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    found.add(f"{source}.{alias.name}")
                elif source in known:
                    found.add(source)
    found.discard(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_ringplug_imports_itself_round_a_circle():
    known = modules()
    graph = {name: imports_of(path, known) for name, path in known.items()}
    assert sum(map(len, graph.values())) > 100, "the import reader found too few imports"
    assert circles(graph) == []


@pytest.mark.parametrize(
    "folder", sorted({p.parent for p in PACKAGE.rglob("*.py")}), ids=lambda p: p.name
)
def test_no_folder_holds_more_than_fifteen_modules(folder):
    names = sorted(path.name for path in folder.glob("*.py"))
    assert len(names) <= MOST_MODULES_A_FOLDER, (
        f"{folder.relative_to(PACKAGE.parent)} holds {len(names)} modules: {names}; "
        "split it into rooms by concern"
    )
