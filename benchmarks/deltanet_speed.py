#!/usr/bin/env python3
"""Forward + backward of one Gated DeltaNet at Qwen3.5-4B's widths: transformers' torch path vs ours.

The delta rule alone: both from the same inputs (B rows x T tokens, 32 value heads, q/k repeated to them, head dim
128, fp32 inside), timed with CUDA events after warm-up, and checked against each other (largest difference of
outputs and input gradients). `--compile` also times `torch.compile` of ours: what fusing the scan would add.
The mixer between its projections (`--compile` only): eager, eager around the compiled rule, and compiled whole
(the product's), on packed rows of five documents.
Usage (device): python3 benchmarks/deltanet_speed.py [--rows 4 --tokens 2048 --compile]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slimtune.train.step.delta_rule import chunk_gated_delta_rule
from slimtune.train.step.deltanet_mixer import compiled_gated_delta_mixer, gated_delta_mixer


def _inputs(rows: int, tokens: int, heads: int = 32, dim: int = 128) -> list[torch.Tensor]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, tokens, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(rows, tokens, heads, device="cuda") * 0.3
    g[:, :: tokens // 5] = -30.0  # document starts, as the packed forward marks them
    beta = torch.rand(rows, tokens, heads, device="cuda", dtype=torch.bfloat16)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _transformers(q, k, v, g, beta):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def _mixer_inputs(rows: int, tokens: int) -> tuple[list, list[torch.Tensor]]:
    """The mixer's arguments (projections, positions of five documents a row, weights) and its leaves."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    key_dim, value_dim, heads, dim = 2048, 4096, 32, 128

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_()

    starts = torch.zeros(rows, tokens, dtype=torch.bool, device="cuda")
    starts[:, :: tokens // 5] = True
    steps = torch.arange(tokens, device="cuda")
    positions = steps - (starts * steps).cummax(1).values
    args = [
        rand(rows, tokens, 2 * key_dim + value_dim),
        rand(rows, tokens, value_dim),
        rand(rows, tokens, heads),
        rand(rows, tokens, heads),
        positions,
        rand(2 * key_dim + value_dim, 1, 4, scale=0.5),
        None,
        rand(heads, scale=0.5, dtype=torch.float32),
        rand(heads, dtype=torch.float32),
        rand(dim, scale=0.1),
        ACT2FN["silu"],
        key_dim,
        dim,
        dim,
        1e-6,
    ]
    return args, [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]


def _time(fn, inputs: list, grad: torch.Tensor, repeats: int = 10, leaves: list | None = None):
    leaves = inputs if leaves is None else leaves
    for _ in range(3):
        out = fn(*inputs)
        grads = torch.autograd.grad(out, leaves, grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        out = fn(*inputs)
        grads = torch.autograd.grad(out, leaves, grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, [out, *grads]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    inputs = _inputs(args.rows, args.tokens)
    grad = torch.randn(args.rows, args.tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
    fns = {"transformers": _transformers, "slimtune": chunk_gated_delta_rule}
    if args.compile:
        fns["slimtune_compiled"] = torch.compile(chunk_gated_delta_rule, dynamic=False)
    results, reference = {}, None
    for name, fn in fns.items():
        ms, tensors = _time(fn, inputs, grad)
        reference = reference or tensors
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(tensors, reference))
        results[name] = {"fwd_bwd_ms": round(ms, 3), "max_diff_vs_transformers": diff}
    if args.compile:
        mixer_args, leaves = _mixer_inputs(args.rows, args.tokens)
        compiled_rule = fns["slimtune_compiled"]
        mixers = {
            "mixer_eager": gated_delta_mixer,
            "mixer_eager_compiled_rule": lambda *a: gated_delta_mixer(*a, rule=compiled_rule),
            "mixer_compiled": compiled_gated_delta_mixer(),
        }
        grad = torch.randn(args.rows, args.tokens, 4096, device="cuda", dtype=torch.bfloat16)
        reference = None
        for name, fn in mixers.items():
            ms, tensors = _time(fn, mixer_args, grad, leaves=leaves)
            reference = reference or tensors
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(tensors, reference))
            results[name] = {"fwd_bwd_ms": round(ms, 3), "max_diff_vs_mixer_eager": diff}
    print(json.dumps({"rows": args.rows, "tokens": args.tokens, "device": torch.cuda.get_device_name(), **results}))


if __name__ == "__main__":
    main()
