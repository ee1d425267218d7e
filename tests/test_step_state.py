"""No hidden state carries the training step: no module under slimtune/ uses a thread-local, and none sets
attributes on a function object. The step's state lives on explicit objects (`slimtune.train.step`: the
checkpointed layers' `_CheckpointedForward`, the model's `LayerPass`), which a reader finds by their class.

What the check sees (an AST walk, no import):
- `threading.local` anywhere (an attribute of the name `threading`), and `from threading import local`;
- `<name>.<attr> = ...` (also annotated or augmented) and `setattr(<name>, ...)`, where `<name>` is a function
  defined by `def` in the same scope (module, class or function body) as the statement, or a scope inside it.
It does not follow a function through another name (`f = forward; f.x = 1`): that is left to review.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "slimtune"
_SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _findings(source: str) -> list[str]:
    """`line: what` for each thread-local and each attribute set on a function object in `source`."""
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) == ("threading", "local"):
                found.add(f"{node.lineno}: threading.local")
        elif isinstance(node, ast.ImportFrom) and node.module == "threading":
            if any(alias.name == "local" for alias in node.names):
                found.add(f"{node.lineno}: from threading import local")
    for scope in (n for n in ast.walk(tree) if isinstance(n, _SCOPES)):
        functions = {n.name for n in scope.body if isinstance(n, _DEFS)}
        for statement in scope.body:
            for node in ast.walk(statement):
                for name, attr in _attribute_writes(node):
                    if name in functions:
                        found.add(f"{node.lineno}: {name}.{attr} set on a function")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def _attribute_writes(node: ast.AST) -> list[tuple[str, str]]:
    """(object name, attribute) that `node` writes: `name.attr = ...`, `name.attr += ...`, `setattr(name, ...)`."""
    if isinstance(node, ast.Assign):
        targets = [t for target in node.targets for t in ast.walk(target)]
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and node.args
        and isinstance(node.args[0], ast.Name)
    ):
        attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
        return [(node.args[0].id, str(attr))]
    else:
        return []
    return [
        (t.value.id, t.attr)
        for t in targets
        if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store) and isinstance(t.value, ast.Name)
    ]


def test_no_module_keeps_training_state_in_a_thread_local_or_on_a_function():
    files = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "train" / "step" / "checkpointing.py" in files  # the walk sees the step's modules
    found = {str(path.relative_to(PACKAGE)): _findings(path.read_text()) for path in files}
    assert not {path: f for path, f in found.items() if f}


def test_the_check_finds_the_old_pattern():
    # how checkpointing carried its state before slimtune.train.step: a thread-local and a patched function's
    # attributes
    old = """
import threading
from threading import local
_PASS = threading.local()

def _patch_layer(layer, mode):
    def forward(*args):
        return forward.listed
    forward._slimtune_checkpointing = True
    forward.listed: list | None = None
    forward.count += 1
    setattr(forward, "graphs", None)
    layer.forward = forward
"""
    assert _findings(old) == [
        "3: from threading import local",
        "4: threading.local",
        "9: forward._slimtune_checkpointing set on a function",
        "10: forward.listed set on a function",
        "11: forward.count set on a function",
        "12: forward.graphs set on a function",
    ]


def test_the_check_leaves_explicit_objects_alone():
    new = """
class _CheckpointedForward:
    def __init__(self, layer):
        self.listed = None

def parameters_from_lists(patched):
    for forward, layer in patched:
        forward.listed = list(layer.parameters())

def _patch_layer(layer):
    forward = _CheckpointedForward(layer)
    layer.forward = forward
"""
    assert _findings(new) == []
