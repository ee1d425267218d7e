"""The README stays a user's README, and the docs it sends users to stay whole.

The README is the first page a user reads and `.ci/run` runs its test command, so it must open with the two
commands and the "your own model on your GPU" section, and stay short (issue 45: it had grown to 767 lines of
measurements). Its performance and memory tables are copies of the ones the benchmarks regenerate in docs/,
so they are checked against those; its family table is checked against `slimtune/models/families.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    ("header", "doc", "markers"),
    [
        ("| model | batch | seq | hf_gc | unsloth | **product** |", "performance.md", "performance"),
        ("| budget (a card size) |", "memory.md", None),
    ],
)
def test_the_readme_tables_are_the_current_ones_in_docs(header: str, doc: str, markers: str | None) -> None:
    source = (REPO / "docs" / doc).read_text(encoding="utf-8")
    if markers:  # the generated section: a regenerated table must be copied into the README too
        source = source.split(f"<!-- {markers}:start -->", 1)[1].split(f"<!-- {markers}:end -->", 1)[0]
    readme_table = _table(README.read_text(encoding="utf-8"), header)
    assert readme_table == _table(source, header), f"copy the table from docs/{doc} into README.md"
