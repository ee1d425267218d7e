"""What a training process holds on the GPU outside the caching allocator, library by library.

The estimate's context term (`slimtune.memory.estimate.CUDA_CONTEXT_BYTES`) is this process on the card less
allocator reserved, measured in whole product runs. This walks the steps a training process takes, one library at
a time, and records after each this process's memory on the card (NVML), the allocator's reserved bytes and their
difference.

It also records the device's used memory three ways, idle and after each step: NVML's v1 memory info (what
`torch.cuda.device_memory_used` returns, which the calibration grids of 2026-11-23/24 recorded), NVML's v2 info
(which reports the driver's reserved memory apart) and cudaMemGetInfo (the total the guard's budget is a share of).

Usage (device): python3 benchmarks/context_probe.py --out "$OUT"   Writes OUT/context_probe.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

MiB = 1024**2


def _steps(dev: torch.device) -> list[tuple[str, Callable[[], object]]]:
    """(what, do it) in the order a training step meets them; each keeps its tensors alive in `kept`."""
    import bitsandbytes.functional as bnbf
    import torch.nn.functional as F

    from slimtune.kernels.fused_linear_ce import fused_linear_cross_entropy
    from slimtune.kernels.rms_norm import rms_norm
    from slimtune.kernels.swiglu import swiglu

    kept: list[object] = []
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)

    def second_stream() -> None:
        with torch.cuda.stream(side):
            kept.append(a @ a)
        side.synchronize()

    def nf4() -> None:
        q, state = bnbf.quantize_4bit(a, quant_type="nf4", compress_statistics=True)
        kept.append(bnbf.dequantize_4bit(q, state))

    def attention() -> None:
        q = torch.randn(1, 32, 2048, 128, device=dev, dtype=torch.bfloat16)
        kept.append(F.scaled_dot_product_attention(q, q, q, is_causal=True))

    def backward() -> None:
        w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
        (a @ w).float().square().mean().backward()
        kept.append(w)

    def adamw() -> None:
        p = torch.nn.Parameter(torch.randn(4096, 16, device=dev))
        p.grad = torch.randn_like(p)
        torch.optim.AdamW([p], fused=True).step()
        kept.append(p)

    def loss() -> None:
        h = torch.randn(512, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(32000, 2048, device=dev, dtype=torch.bfloat16)
        labels = torch.randint(0, 32000, (512,), device=dev)
        kept.append(fused_linear_cross_entropy(h, w, labels))

    def graph() -> None:
        g = torch.cuda.CUDAGraph()
        static = a.clone()
        with torch.cuda.graph(g):
            kept.append(static @ static)
        g.replay()
        kept.append(g)

    return [
        ("CUDA context (a first tensor)", lambda: kept.append(torch.zeros(1, device=dev))),
        ("cuBLAS: a bf16 matmul", lambda: kept.append(a @ a)),
        ("cuBLAS on a second stream", second_stream),
        ("bitsandbytes NF4 quantize + dequantize", nf4),
        ("SDPA flash attention", attention),
        ("autograd backward of a matmul", backward),
        ("fused AdamW step", adamw),
        ("Triton: rms_norm", lambda: kept.append(rms_norm(a, torch.ones(2048, device=dev, dtype=a.dtype), 1e-5))),
        ("Triton: swiglu", lambda: kept.append(swiglu(a, a))),
        ("Triton: fused linear cross-entropy", loss),
        ("a CUDA graph captured and replayed", graph),
    ]


def _device_views(dev: torch.device | None, index: int = 0) -> dict:
    """The device's memory in MiB as NVML v1, NVML v2 and (with a context) cudaMemGetInfo report it."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    views = {
        "nvml_v1": {"total": v1.total // MiB, "used": v1.used // MiB, "free": v1.free // MiB},
        "nvml_v2": {k: getattr(v2, k) // MiB for k in ("total", "reserved", "used", "free")},
    }
    if dev is not None:
        free, total = torch.cuda.mem_get_info(dev)
        views["cuda_mem_get_info"] = {"total": total // MiB, "used": (total - free) // MiB}
    return views


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "context_probe_out"))
    args = p.parse_args()
    from slimtune.core.device import resolve_device
    from slimtune.memory.device_usage import process_reader

    dev = resolve_device("auto")  # the product's allocator settings (expandable segments)
    if dev.type != "cuda":
        print(json.dumps({"skipped": "no GPU"}))
        return 0
    idle = _device_views(None, dev.index or 0)  # before this process makes a context
    torch.zeros(1, device=dev)
    used = process_reader(dev)
    rows = []
    for what, step in _steps(dev):
        step()
        torch.cuda.synchronize(dev)
        held, reserved = used() if used else None, torch.cuda.memory_reserved(dev)
        rows.append(
            {
                "step": what,
                "process_mib": None if held is None else round(held / MiB),
                "reserved_mib": round(reserved / MiB),
                "outside_allocator_mib": None if held is None else round((held - reserved) / MiB),
                "device": _device_views(dev, dev.index or 0),
            }
        )
        print(f"{what:42s} process {rows[-1]['process_mib']} MiB, outside the allocator "
              f"{rows[-1]['outside_allocator_mib']} MiB", flush=True)  # fmt: skip
    result = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING"),
        "idle": idle,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_probe.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
