"""The package's folders form layers: imports only go down, and no import cycle passes through a folder.

The layers, top to bottom (`LAYERS`); a module may import its own layer and the ones below it, never one above:

    cli/                      the command line (`slimtune init|validate|plan|run|eval|generate|chat`)
    checks/                   what `validate` and `run` check outside the spec before any model loads
    flows/                    the Prefect flows: the six tasks in order, the run lock, crash re-submission
    tasks/                    the six stages as plain functions
    plan/                     what a run will do, decided before a model loads: RunPlan, TrainSettings, the fit
    train/                    the Trainer and the training step
    inference/ report/        using a finished run; what a run shows people (reports, charts, artifacts)
    data/ merge/ export/      records and packing; the 16-bit merge; GGUF and the Hub push
    memory/ kernels/          the guard, estimates and downshifts; Triton kernels
    spec/                     the pipeline spec, which every stage reads
    models/                   model families, the built-in tiny models, where a model's files are
    core/                     primitives and tables: atomic writes, bounded parsing, device, GGUF types, live models

The root holds only `__init__.py`. An edge is any import between two folders, deferred ones inside functions
included (they are still a dependency), imports under `if TYPE_CHECKING:` left out (annotations only).
Folders of one layer may import each other as long as no cycle forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "slimtune"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("checks",),
    ("flows",),
    ("tasks",),
    ("plan",),
    ("train",),
    ("inference", "report"),
    ("data", "merge", "export"),
    ("memory", "kernels"),
    ("spec",),
    ("models",),
    ("core",),
)
_RANK = {folder: depth for depth, layer in enumerate(LAYERS) for folder in layer}


def _node(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "slimtune" or len(parts) < 2:
        return None
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[tuple[str, int]]:
    """(imported dotted name, line) of every import outside `if TYPE_CHECKING:`."""
    found: set[tuple[str, int]] = set()
    skip = {
        id(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for n in ast.walk(n)
    }
    package = module.split(".") if is_package else module.split(".")[:-1]
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            found.update((a.name, n.lineno) for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = package[: len(package) - n.level + 1] if n.level else []
            target = ".".join(base + ([n.module] if n.module else []))
            found.add((target, n.lineno))
            found.update((f"{target}.{a.name}", n.lineno) for a in n.names)  # `from slimtune.core import atomic`
    return found


def _modules():
    """(path, dotted module, is_package) for every module of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield path, ".".join(parts[:-1] if is_package else parts), is_package


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path, module, is_package in _modules():
        source = _node(module)
        if source is None:
            continue
        for target, _line in _imports(ast.parse(path.read_text()), module, is_package):
            node = _node(target)
            if node and node != source and (node.endswith("/") or (PACKAGE / f"{node}.py").is_file()):
                edges.setdefault(source, set()).add(node)
    return edges


def _folder_edges() -> list[tuple[str, str, str, str]]:
    """(where, source folder, imported module, target folder) for every import from one folder into another."""
    edges = []
    for path, module, is_package in _modules():
        source = _node(module)
        if source is None or not source.endswith("/"):
            continue
        for target, line in _imports(ast.parse(path.read_text()), module, is_package):
            node = _node(target)
            if node and node.endswith("/") and node != source:
                where = f"{path.relative_to(PACKAGE.parent)}:{line}"
                edges.append((where, source.rstrip("/"), target, node.rstrip("/")))
    shortest: dict[tuple[str, str], tuple[str, str, str, str]] = {}
    for edge in sorted(edges, key=lambda e: len(e[2])):  # `from a.b import c`: name a.b, not also a.b.c
        shortest.setdefault((edge[0], edge[3]), edge)
    return sorted(shortest.values())


def _upward(edges: list[tuple[str, str, str, str]], rank: dict[str, int]) -> list[str]:
    """One line per import of a higher layer, naming the module, the line and what it imports."""
    return [
        f"{where} imports {target} ({source}/ -> {folder}/ is upward)"
        if source in rank and folder in rank
        else f"{where} imports {target} ({source}/ -> {folder}/: a folder missing from LAYERS)"
        for where, source, target, folder in edges
        if source not in rank or folder not in rank or rank[folder] < rank[source]
    ]


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


def test_every_module_sits_in_a_layered_folder():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert root == ["__init__.py"], f"slimtune/ holds {root}: move each module into the folder that says what it is"
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == set(_RANK), (
        f"folders without a layer: {sorted(folders - set(_RANK))}; "
        f"layers without a folder: {sorted(set(_RANK) - folders)} (LAYERS, and the docstring's picture)"
    )


def test_imports_only_go_down_the_layers():
    edges = _folder_edges()
    assert {"flows", "tasks", "train", "memory", "kernels"} <= {e[1] for e in edges}  # the walk sees the package
    upward = _upward(edges, _RANK)
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_the_layer_check_finds_an_upward_import():
    edges = [
        ("slimtune/memory/guard.py:12", "memory", "slimtune.train.trainer", "train"),  # up two layers
        ("slimtune/train/trainer.py:30", "train", "slimtune.memory.guard", "memory"),  # down
        ("slimtune/kernels/apply.py:8", "kernels", "slimtune.memory.estimate", "memory"),  # same layer
    ]
    assert _upward(edges, _RANK) == [
        "slimtune/memory/guard.py:12 imports slimtune.train.trainer (memory/ -> train/ is upward)"
    ]


def test_the_walk_sees_deferred_imports_and_skips_annotation_only_ones():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from slimtune.flows.finetune import finetune\n"
        "def f():\n"
        "    from slimtune.tasks.load_4bit import load_4bit\n"
    )
    found = {name for name, _line in _imports(ast.parse(source), "slimtune.memory.guard", False)}
    assert "slimtune.tasks.load_4bit" in found and "slimtune.flows.finetune" not in found


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
