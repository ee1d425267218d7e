"""A training step's time on a GPU, predicted from the model's shape: what `micro_batch_size: auto` weighs where the
budget holds a micro-batch with CUDA graphs, or a larger one without them, but not the larger one with them.

Per decoder layer and micro-batch, the host launches the layer's kernels one by one while the GPU computes them: a
phase takes the longer of the two. The forward (a third of the compute: forward, recomputed forward, input
gradients) is launched eagerly either way; with graphs the backward (the other two thirds) is one replay, its
compute alone. So graphs pay most where a micro-batch is small against the layer's weights (Llama-3.2-1B at 2048
tokens: launch-bound), and twice the micro-batch pays more where the compute already outlasts most of the launches
(Llama-3.1-8B at 2048 tokens).

Fitted to `slimtune run` on H200s and H100s (steady tokens/s; predicted in brackets):
- 1B, 2.98 GiB budget, one call, side by side: 4 x 1 eager 51,691 (41,626) > 2 x 2 graphed 46,957 (40,045) >
  1 x 4 graphed 26,634 (23,719) > 2 x 2 eager 22,925 (20,813); unbudgeted 4 x 1 graphed 58,799 (61,056).
- 8B: 1 x 1 eager 5,217 (5,203), graphed 7,975 (8,027); micro-batch 2 eager 10,086 (10,407; an H100),
  graphed 11,200-11,364 (11,085); 4, 8 and 16 graphed or eager 11,840-12,020 (11,940).
Rates depend on the machine (a faster host shortens the launches), so only the order of two choices is used.
"""

from __future__ import annotations

from typing import Any

from slimtune.memory.model_shape import model_shape

_FORWARD_LAUNCH_S = 4.4e-3  # per layer and micro-batch: the forward's kernel launches, eager either way
_BACKWARD_LAUNCH_S = 7.9e-3  # the recomputed forward's and the backward's launches, eager; a replay without graphs
_SECONDS_PER_WEIGHT_TOKEN = 1.2e-14  # a layer's whole compute (forward, recompute, backward) per token and weight


def step_seconds(cfg: dict[str, Any], tokens: int, graphs: bool) -> float:
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


def graphs_pay(cfg: dict[str, Any], row_tokens: int, graphed: int, eager: int) -> tuple[bool, float]:
    """Whether micro-batch `graphed` with CUDA graphs trains at least as many tokens/s as micro-batch `eager`
    without them (rows of `row_tokens`), and that predicted ratio."""
    rate = graphed / step_seconds(cfg, graphed * row_tokens, True)
    ratio = rate / (eager / step_seconds(cfg, eager * row_tokens, False))
    return ratio >= 1.0, ratio
