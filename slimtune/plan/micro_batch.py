"""The micro-batches `micro_batch_size: auto` may choose, and its choice among those the budget runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from slimtune.spec.schema import TrainSpec

# Tokens per micro-batch from which a step is bound by the GPU's arithmetic: 8B at 4, 8 and 16 x 2048 trained within
# 1.5% tokens/s of each other on an H200 (benchmarks/results/memory/h200-2026-11-26-budget-speed.json), where 12
# stored layers at 4 x 2048 trained 9.7% faster than none (h200-2026-11-27-stored-layers.json).
GPU_BOUND_TOKENS = 8192
_MAX_MICRO_BATCH = 256


def micro_batch_candidates(train: TrainSpec) -> list[int]:
    """Micro-batches `auto` may choose: divisors of the effective batch, so accumulation keeps it exact;
    for a fixed micro-batch, 1 to 256 (what the planner reports as the largest that fits)."""
    if train.micro_batch_size == "auto":
        n = train.effective_batch_size
        return [d for d in range(1, n + 1) if n % d == 0]
    return list(range(1, _MAX_MICRO_BATCH + 1))


class Graphs(NamedTuple):
    """Where CUDA graphs of the layers' backward can be on: whether a micro-batch runs with them, and the predicted
    tokens/s of a micro-batch with them over a larger one without (`step_speed.graphs_speedup`)."""

    runs: Callable[[int], bool]
    speedup: Callable[[int, int], float]


def auto_micro_batch(
    train: TrainSpec, fits: Callable[[int], bool], row_tokens: int | None = None, graphs: Graphs | None = None
) -> tuple[int, int, str]:
    """(micro_batch, accumulation, note) for `micro_batch_size: auto`: the largest divisor of the effective batch
    for which `fits(micro_batch)` holds, or a smaller one that runs with CUDA graphs where those are predicted to
    pay more (`graphs`); 1 when none fits (the preflight then says why).

    `row_tokens`: the tokens of one row, given where layers can be stored; the micro-batch then stops at the first
    divisor that reaches `GPU_BOUND_TOKENS`, beyond which a larger one barely speeds a step: the memory it would
    take buys more speed as stored layers (`train.stored_layers`).
    """
    n = train.effective_batch_size
    candidates = micro_batch_candidates(train)
    if row_tokens:
        bound = next((d for d in candidates if d * row_tokens >= GPU_BOUND_TOKENS), candidates[-1])
        candidates = [d for d in candidates if d <= bound]
    best = largest_micro_batch(fits, candidates)
    with_graphs = largest_micro_batch(graphs.runs, candidates) if graphs else None
    weighed = ""
    if graphs and with_graphs is not None and best is not None and best > with_graphs:
        ratio = graphs.speedup(with_graphs, best)
        if ratio >= 1.0:  # a tie (both compute-bound) to the smaller one: it leaves more to stored layers
            weighed = f"; predicted {ratio:.2f}x the tokens/s of micro-batch {best} without them"
            best = with_graphs
        else:
            weighed = f"; predicted {1 / ratio:.2f}x the tokens/s of micro-batch {with_graphs} with CUDA graphs"
    with_them = " with CUDA graphs" if best is not None and best == with_graphs else ""
    why = f"the largest divisor whose estimate{with_them} runs on the budget"
    mb = best or 1
    if row_tokens and best == candidates[-1] and candidates[-1] < n:
        why = f"the first divisor of {GPU_BOUND_TOKENS} tokens or more, the rest of the budget to stored layers"
    note = f"micro_batch_size auto: {mb} x {n // mb} accumulation (effective batch {n}); " + (
        why + weighed if best else "none fits the budget, trying 1"
    )
    return mb, n // mb, note


def largest_micro_batch(fits: Callable[[int], bool], candidates: list[int]) -> int | None:
    """The largest candidate for which `fits(micro_batch)` holds (estimates grow with the micro-batch)."""
    return next((mb for mb in sorted(candidates, reverse=True) if fits(mb)), None)
