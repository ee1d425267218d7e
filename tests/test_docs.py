"""The README stays a user's README, and the docs it sends users to stay whole.

The README is the first page a user reads and `.ci/run` runs its test command, so it must open with the two
commands and the "your own model on your GPU" section, and stay short (issue 45: it had grown to 767 lines of
measurements). Its headline table is generated from the committed results (`benchmarks/headline.py`) and its
budget table is a copy of docs/memory.md's, so both are checked; its family table is checked against
`slimtune/models/families.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import headline
from benchmarks.common import generated_section
from slimtune.models.families import FAMILIES

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md")) + [README, REPO / "benchmarks" / "README.md"]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _table(text: str, header: str) -> str:
    """The Markdown table that starts with the line `header`, up to its first blank line."""
    start = text.index(header)
    return text[start : text.index("\n\n", start)]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_a_file_of_the_repository(page: Path) -> None:
    links = _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))
    relative = [link.split("#")[0] for link in links if "://" not in link and not link.startswith(("#", "mailto:"))]
    missing = [link for link in relative if not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to files that do not exist: {missing}"


def test_the_readme_opens_with_the_two_commands_then_your_own_model_on_your_gpu() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, "README.md is for users: move measurements and details to docs/"
    assert text.startswith("# slimtune\n\n```sh\n"), "README.md must open with the two commands"
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert len(first_block) == 2 and "slimtune run deployments/tiny.yaml" in first_block[0], first_block
    assert "pytest" in first_block[1], "the second command is the test command .ci/run runs"
    headings = re.findall(r"^## .*$", _FENCE.sub("", text), re.MULTILINE)
    assert headings[0] == "## Fine-tune your own model on your GPU", headings


def test_the_family_table_lists_every_supported_architecture() -> None:
    table = _table(README.read_text(encoding="utf-8"), "| `model_type` | transformers class | e.g. |")
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    listed = {model_type.strip().strip("`"): cls.strip().strip("`") for model_type, cls in rows}
    assert listed == {name: family.architecture for name, family in FAMILIES.items()}


def test_the_readme_budget_table_is_the_current_one_in_docs() -> None:
    header = "| budget (a card size) |"
    readme_table = _table(README.read_text(encoding="utf-8"), header)
    assert readme_table == _table((REPO / "docs" / "memory.md").read_text(encoding="utf-8"), header), (
        "copy the table from docs/memory.md into README.md"
    )


@pytest.mark.parametrize("page", headline.TARGETS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_headline_table_is_the_one_the_committed_results_give(page: Path) -> None:
    shown = generated_section(page.read_text(encoding="utf-8"), headline.SECTION)
    assert shown == headline.render(*headline.load_cells()), "run python3 benchmarks/headline.py --write"
