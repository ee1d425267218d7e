"""Device and dtype choices, made once from the spec so that every task agrees."""

from __future__ import annotations

import os

import torch

# The caching allocator's default pools fragment under training's churn: 8B at 1 x 2048 with "unsloth"
# checkpointing had 5.19 GiB allocated but needed 5.96 GiB reserved, and ran out of a 6 GiB budget
# (benchmarks/results/memory/). Expandable segments grow one mapped segment per stream instead, so reserved
# follows allocated. CUDA reads the setting when its allocator starts, so it is set before anything touches
# CUDA; a user's own setting wins.
ALLOCATOR_SETTINGS = "expandable_segments:True"


def prefer_expandable_segments() -> None:
    """Ask for expandable segments unless the user configured the CUDA allocator."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS


def resolve_device(name: str) -> torch.device:
    """auto -> cuda:0 when a GPU is present, else cpu; a clear error for a GPU that is not there."""
    if name != "cpu":
        prefer_expandable_segments()
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device("cuda:0" if name == "cuda" else name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"model.device is {name!r} but no CUDA GPU is visible; use model.device: cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"model.device is {name!r} but only {torch.cuda.device_count()} GPU(s) exist")
    return dev


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto -> bf16 on GPUs that support it, fp16 on older GPUs (e.g. T4), fp32 on CPU."""
    if name != "auto":
        dtype = getattr(torch, name)
        if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeError("model.compute_dtype bfloat16 is not supported on this GPU; use float16 or auto")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
