"""A micro-batch's time through the decoder layers, predicted from the model's shape: what `micro_batch_size: auto`
weighs where the budget holds a micro-batch with CUDA graphs, or a larger one without them, but not the larger one
with them.

Per decoder layer and micro-batch, the host launches the layer's kernels one by one while the GPU computes them: a
phase takes the longer of the two. The forward (a third of the compute: forward, recomputed forward, input
gradients) is launched eagerly either way; with graphs the backward (the other two thirds) is one replay, its
compute alone. So graphs pay most where a micro-batch is small against the layer's weights (Llama-3.2-1B at 2048
tokens: launch-bound), and twice the micro-batch pays more where the compute already outlasts most of the launches
(Llama-3.1-8B at 2048 tokens). The lm_head, the loss and the optimizer, the same either way, are left out.

Fitted to steady tokens/s of `slimtune run` (tests/test_step_speed.py holds the model to the files):
- 1B at 4 x 2048 on a 2.98 GiB budget, one H200 call (benchmarks/results/user/h200-2026-11-28c-graphs-first.json,
  call 1): 4 x 1 eager 51,691 > 2 x 2 graphed 46,957 > 1 x 4 graphed 26,634 > 2 x 2 eager 22,925.
- 8B at 2048 tokens: 2 x 2 graphed 11,200 > 1 x 1 graphed 7,975 (call 4 of that file) > 1 x 1 eager 5,217
  (h200-2026-11-27-headline.json); 4, 8 and 16 rows graphed or eager 11,816-12,027 (one H200 call,
  benchmarks/results/memory/h200-2026-11-26-budget-speed.json). Micro-batch 2 eager: 10,086 on an H100 under an
  8 GiB budget (benchmarks/results/budgets/h100-2026-11-28-8b-under-budgets.json). That file kept only the
  printed row: micro-batch 2 without graphs is inferred from its budget and its 6.49 GiB allocated peak (1 x 1:
  5.49; that code's plan kept graphs off at 8 GiB).
Rates depend on the machine (a faster host shortens the launches), so only the order of two choices is used.
"""

from __future__ import annotations

from typing import Any

from slimtune.memory.model_shape import model_shape

_FORWARD_LAUNCH_S = 4.4e-3  # per layer and micro-batch: the forward's kernel launches, eager either way
_BACKWARD_LAUNCH_S = 7.9e-3  # the recomputed forward's and the backward's launches, eager; with graphs one replay
_SECONDS_PER_WEIGHT_TOKEN = 1.2e-14  # a layer's whole compute (forward, recompute, backward) per token and weight


def layers_seconds(cfg: dict[str, Any], tokens: int, graphs: bool) -> float:
    """Predicted seconds of one micro-batch of `tokens` through every decoder layer, forward and backward, with
    the layers' backward as CUDA graphs or eager."""
    shape = model_shape(cfg)
    seconds = 0.0
    for layer in shape.each_layer():
        weights = sum(a * b * shape.routed(name) for name, (a, b) in layer.items())
        compute = _SECONDS_PER_WEIGHT_TOKEN * weights * tokens
        backward = 2 * compute / 3
        seconds += max(_FORWARD_LAUNCH_S, compute / 3)
        seconds += backward if graphs else max(_BACKWARD_LAUNCH_S, backward)
    return seconds


def graphs_speedup(cfg: dict[str, Any], row_tokens: int, graphed: int, eager: int) -> float:
    """Predicted tokens/s of micro-batch `graphed` with CUDA graphs over micro-batch `eager` without them (rows of
    `row_tokens`): above 1 the graphs pay more than the larger micro-batch."""
    rate = graphed / layers_seconds(cfg, graphed * row_tokens, True)
    return rate / (eager / layers_seconds(cfg, eager * row_tokens, False))
