#!/usr/bin/env python3
"""Forward + backward of one Gated DeltaNet delta rule at Qwen3.5-4B's widths: transformers' torch path vs ours.

Both from the same inputs (B rows x T tokens, 32 value heads, q/k repeated to them, head dim 128, fp32 inside),
timed with CUDA events after warm-up, and checked against each other (largest difference of outputs and input
gradients). `--compile` also times `torch.compile` of ours: what fusing the scan would add.
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


def _time(fn, inputs: list[torch.Tensor], grad: torch.Tensor, repeats: int = 10) -> tuple[float, list[torch.Tensor]]:
    for _ in range(3):
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, grad)
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
    print(json.dumps({"rows": args.rows, "tokens": args.tokens, "device": torch.cuda.get_device_name(), **results}))


if __name__ == "__main__":
    main()
