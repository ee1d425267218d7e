"""The headline table is read from user_compare.py results, and refuses what is not a like-for-like pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import headline

_ENV = {
    "gpu": "NVIDIA H200",
    "gpu_memory": "143771 MiB",
    "driver": "580",
    "versions": {v: "1.0" for v in ("torch", "transformers", "trl", "unsloth", "peft", "bitsandbytes")},
}


def _row(config: str, rate: float | None, card: float, **extra: object) -> dict:
    return {
        "config": config,
        "status": "ok" if rate else "error",
        "steady_tokens_per_s": rate,
        "card_peak_gib": card,
        "process_peak_allocated_gib": card - 1,
        **extra,
    }


_SET = {"model": "1b", "batch": 4, "seq": 2048, "match_card_of": "unsloth", "set": ["train.micro_batch_size=2"]}


def _result(ours: dict, *, gpu: str = "NVIDIA H200", match: str | None = "unsloth") -> dict:
    settings = {"model": "1b", "batch": 4, "seq": 2048, "steps": 20, "warmup": 3, "match_card_of": match}
    return {"env": {**_ENV, "gpu": gpu}, "settings": settings, "rows": [_row("unsloth", 1000.0, 3.0), ours]}


def _manifest(tmp_path: Path, results: dict[str, dict], notes: dict[str, str] | None = None) -> Path:
    (tmp_path / "h200-2026-11-28-x.json").write_text(json.dumps({"call 1": results}))
    cells = [
        {"file": "h200-2026-11-28-x.json", "at": ["call 1", k], **({"note": notes[k]} if notes and k in notes else {})}
        for k in results
    ]
    manifest = tmp_path / "headline.json"
    manifest.write_text(json.dumps({"target": 1.15, "runs": "One call.", "attention": "SDPA.", "cells": cells}))
    return manifest


def test_ratios_and_the_count_of_cells_that_meet_the_target_come_from_the_rows(tmp_path: Path) -> None:
    fast = _row("slimtune", 1500.0, 2.5, micro_batch_x_accumulation="2 x 2", cuda_graphs="8 captured", stored_layers=1)
    over_card = _row("slimtune", 2000.0, 3.5, micro_batch_x_accumulation="4 x 1", cuda_graphs=None)
    slow = _row("slimtune", 1100.0, 2.0, micro_batch_x_accumulation="1 x 4", cuda_graphs=None)
    manifest = _manifest(tmp_path, {"a": _result(fast), "b": _result(over_card), "c": _result(slow)}, {"c": "older"})
    text = headline.render(*headline.load_cells(manifest))

    rows = [line for line in text.splitlines() if line.startswith("| Llama-3.2-1B 4 x 2048")]
    assert len(rows) == 3
    assert "2 x 2, graphs on, 1 layer stored: 1,500, 2.50 GiB (1.50) | **1.50x** | 20 | 2026-11-28" in rows[0]
    assert "4 x 1, graphs off: 2,000, 3.50 GiB (2.50) | **2.00x**" in rows[1]
    assert rows[2].startswith("| Llama-3.2-1B 4 x 2048 (1) |") and "**1.10x**" in rows[2]
    assert "(1) older" in text and f"from {manifest};" in text
    # 2.00x on more of the card than Unsloth's, and 1.10x, do not count
    assert "no more of the card: 1 of 3." in text


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ({"a": _result(_row("slimtune", None, 2.0))}, "one completed slimtune row"),
        ({"a": _result(_row("slimtune", 1500.0, 2.0), match=None)}, "not run with --match-card-of unsloth"),
        (
            {"a": _result(_row("slimtune", 1500.0, 2.0)), "b": _result(_row("slimtune", 1500.0, 2.0), gpu="H100")},
            "the cells differ in gpu",
        ),
        ({"a": {**_result(_row("slimtune", 1500.0, 2.0)), "settings": _SET}}, "slimtune ran with --set"),
    ],
)
def test_a_cell_that_is_not_a_like_for_like_pair_is_refused(tmp_path: Path, results: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        headline.render(*headline.load_cells(_manifest(tmp_path, results)))


def test_a_path_that_leads_nowhere_names_the_file_and_the_key(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path, {"a": _result(_row("slimtune", 1500.0, 2.0))})
    spec = json.loads(manifest.read_text())
    spec["cells"][0]["at"] = ["call 9", "a"]
    manifest.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"h200-2026-11-28-x.json .*no 'call 9'"):
        headline.load_cells(manifest)
