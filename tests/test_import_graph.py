"""The package's folders form layers: no import cycle passes through a subfolder of slimtune/.

Nodes are the subfolders (memory/, flows/, tasks/, ...) and the root modules one by one; an edge is any
import between two nodes, deferred ones inside functions included (they are still a dependency), imports
under `if TYPE_CHECKING:` left out (annotations only). Two root modules may import each other: they share
a folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "slimtune"


def _node(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "slimtune" or len(parts) < 2:
        return None
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    found: set[str] = set()
    skip = {
        id(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
        for n in ast.walk(n)
    }
    package = module.split(".") if is_package else module.split(".")[:-1]
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = package[: len(package) - n.level + 1] if n.level else []
            target = ".".join(base + ([n.module] if n.module else []))
            found.add(target)
            found.update(f"{target}.{a.name}" for a in n.names)  # `from slimtune import atomic`
    return found


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        source = _node(module)
        if source is None:
            continue
        for target in _imports(ast.parse(path.read_text()), module, is_package):
            node = _node(target)
            if node and node != source and (node.endswith("/") or (PACKAGE / f"{node}.py").is_file()):
                edges.setdefault(source, set()).add(node)
    return edges


def _components(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            out.append(component)

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_passes_through_a_subfolder():
    edges = _graph()
    assert {"flows/", "tasks/", "memory/", "train/"} <= set(edges)  # the walk sees the package
    cycles = [c for c in _components(edges) if len(c) > 1 and any(n.endswith("/") for n in c)]
    assert not cycles, cycles


def test_the_check_finds_a_cycle():
    edges = {"plan": {"flows/"}, "flows/": {"plan", "tasks/"}, "tasks/": set(), "spec": {"overrides"}}
    edges["overrides"] = {"spec"}
    found = [c for c in _components(edges) if len(c) > 1]
    assert {"plan", "flows/"} in found and {"spec", "overrides"} in found
