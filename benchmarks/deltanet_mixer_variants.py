#!/usr/bin/env python3
"""Where the compiled Gated DeltaNet mixer's time goes, and what TF32 matmuls or CUDA graphs would add.

Forward + backward of `gated_delta_mixer` at Qwen3.5-4B's widths (4 x 2048 tokens, packed rows of five
documents, `deltanet_speed._mixer_inputs`): the CUDA kernels of three repeats by total time (torch.profiler),
then the time per repeat compiled as the product compiles it, with TF32 allowed for fp32 matmuls, and through
CUDA graphs (mode="reduce-overhead"), with each variant's relative difference from the first (outputs and
every input gradient). At 2026-11-27 (aff56a9, H200) this showed the batched triangular solves at a quarter of
the time, TF32 slower (15.6 vs 13.8 ms) and graphs within 3% (13.4 ms): the solves went, the others did not
come in (benchmarks/results/families/h200-2026-11-27c-qwen35-issue42.md).
Usage (device): python3 benchmarks/deltanet_mixer_variants.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.deltanet_speed import _mixer_inputs, _time
from slimtune.train.step.deltanet_mixer import gated_delta_mixer


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _kernels(fn, args: list, leaves: list, grad: torch.Tensor, rows: int) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.autograd.grad(fn(*args), leaves, grad)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90)


def main() -> None:
    args, leaves = _mixer_inputs(4, 2048)
    grad = torch.randn(4, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    results = {}
    compiled = torch.compile(gated_delta_mixer)
    results["compiled_ms"], reference = _time(compiled, args, grad, leaves=leaves)
    print(_kernels(compiled, args, leaves, grad, 30))
    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = True
    tf32 = torch.compile(gated_delta_mixer)
    results["compiled_tf32_ms"], tensors = _time(tf32, args, grad, leaves=leaves)
    results["tf32_relative_difference"] = [round(_relative(a, b), 6) for a, b in zip(tensors, reference)]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    graphs = torch.compile(gated_delta_mixer, mode="reduce-overhead")
    results["compiled_cudagraphs_ms"], tensors = _time(graphs, args, grad, leaves=leaves)
    results["cudagraphs_relative_difference"] = [round(_relative(a, b), 6) for a, b in zip(tensors, reference)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
