"""The step-time model `micro_batch_size: auto` weighs graphs with: it ranks the committed measurements as they were
measured, where runs of one call differ by more than their noise, and sees no difference where they had none."""

from __future__ import annotations

import json
import statistics
from itertools import combinations
from pathlib import Path

import pytest
from model_configs import LLAMA_1B, LLAMA_8B

from slimtune.plan.step_speed import graphs_speedup, layers_seconds

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
_NOISE = 0.05  # runs of one call closer than this are not ranked


def _predicted(cfg: dict, micro_batch: int, graphs: bool, seq: int = 2048) -> float:
    return micro_batch * seq / layers_seconds(cfg, micro_batch * seq, graphs)


def _user_compare_rows(call: str) -> list[tuple[int, bool, float]]:
    """(micro-batch, graphs, steady tokens/s) of each slimtune run of one device call."""
    data = json.loads((RESULTS / "user" / "h200-2026-11-28c-graphs-first.json").read_text())
    rows = [r for result in data[call].values() for r in result["rows"] if r["config"] == "slimtune"]
    return [
        (int(r["micro_batch_x_accumulation"].split(" x ")[0]), bool(r["cuda_graphs"]), r["steady_tokens_per_s"])
        for r in rows
    ]


@pytest.mark.parametrize(("call", "cfg"), [("call 1", LLAMA_1B), ("call 4", LLAMA_8B)])
def test_the_model_ranks_the_runs_of_one_call_as_measured(call: str, cfg: dict) -> None:
    """Call 1: 1B at 4 x 2048 on a 2.98 GiB budget, four settings; call 4: 8B at 1 x 1 and 2 x 2 with graphs."""
    runs = _user_compare_rows(call)
    assert len(runs) >= 2
    ranked = 0
    for (mb_a, g_a, rate_a), (mb_b, g_b, rate_b) in combinations(runs, 2):
        if abs(rate_a / rate_b - 1) <= _NOISE:
            continue
        ranked += 1
        predicted = _predicted(cfg, mb_a, g_a) > _predicted(cfg, mb_b, g_b)
        assert predicted == (rate_a > rate_b), ((mb_a, g_a, rate_a), (mb_b, g_b, rate_b))
    assert ranked >= 1


def test_where_the_gpu_is_busy_neither_graphs_nor_a_larger_micro_batch_is_predicted_to_pay() -> None:
    """8B at 4, 8 and 16 x 2048 with graphs and 16 without trained within 3% of each other (one H200 call)."""
    data = json.loads((RESULTS / "memory" / "h200-2026-11-26-budget-speed.json").read_text())
    measured, predicted = [], []
    for run in data["runs"]:
        graphs = "captured" in run["cuda_graphs"]
        measured.append(statistics.median(run["tok_s"][2:]))  # step 1 warms up, graphs are captured at step 2
        predicted.append(_predicted(LLAMA_8B, run["train"]["micro_batch_size"], graphs))
    assert max(measured) / min(measured) < 1.03 and max(predicted) / min(predicted) < 1.03, (measured, predicted)


def test_graphs_pay_at_1b_and_twice_the_micro_batch_pays_at_8b() -> None:
    """The 8B pair comes from two machines: 1 x 1 with graphs on an H200 (call 4), micro-batch 2 without them under
    an 8 GiB budget on an H100 (the printed row of that call: its settings inferred, step_speed's docstring)."""
    assert graphs_speedup(LLAMA_1B, 2048, 1, 2) > 1.05
    assert graphs_speedup(LLAMA_8B, 2048, 1, 2) < 0.85
    (one_graphed,) = [rate for mb, graphs, rate in _user_compare_rows("call 4") if (mb, graphs) == (1, True)]
    budgets = json.loads((RESULTS / "budgets" / "h100-2026-11-28-8b-under-budgets.json").read_text())
    (two_eager,) = [
        r["steady_tokens_per_s"] for r in budgets["printed_rows"] if (r["tool"], r["gpu_budget_gib"]) == ("slimtune", 8)
    ]
    assert _predicted(LLAMA_8B, 1, True) == pytest.approx(one_graphed, rel=0.1)
    assert _predicted(LLAMA_8B, 2, False) == pytest.approx(two_eager, rel=0.1)
