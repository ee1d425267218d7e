"""Nothing in the checkout shadows a package that bitsandbytes or transformers import.

pytest puts tests/ on sys.path (its conftest.py has no package), and python puts the repo root there for
`python -m`; a folder named `kernels` in either would be imported in place of Hugging Face's `kernels`
package (seen: bitsandbytes' CPU backend failing with "cannot import name 'get_kernel' from 'kernels'").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Top-level names other libraries import, and the card's folders, which live inside slimtune/.
_RESERVED = ("kernels", "tasks", "flows", "memory", "train", "data", "export", "merge")


@pytest.mark.parametrize("folder", [REPO, REPO / "tests"], ids=["repo root", "tests"])
def test_no_top_level_module_shadows_a_library(folder: Path):
    clashes = [n for n in _RESERVED if (folder / n).is_dir() or (folder / f"{n}.py").is_file()]
    assert clashes == [], f"{folder} holds {clashes}: move them inside slimtune/ or rename the test folder"


def test_kernels_resolves_outside_the_checkout():
    spec = importlib.util.find_spec("kernels")
    origin = None if spec is None else (spec.origin or next(iter(spec.submodule_search_locations or []), None))
    assert origin is None or REPO not in Path(origin).resolve().parents, origin


# STYLE.md: modules under ~500 lines, split by concern; the spec (one model per stage, a docstring on every field)
# is the one exception.
_MAX_LINES = 500
_LONG_ALLOWED = {"slimtune/spec/schema.py"}


def test_no_module_exceeds_500_lines_except_the_spec():
    lines = {
        p.relative_to(REPO).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in REPO.glob("slimtune/**/*.py")
    }
    long = {path: n for path, n in sorted(lines.items()) if n > _MAX_LINES and path not in _LONG_ALLOWED}
    assert long == {}, f"over {_MAX_LINES} lines: {long}; split each by concern into modules named for what they do"
