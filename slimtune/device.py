"""Device and dtype choices, made once from the spec so that every task agrees."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """auto -> cuda:0 when a GPU is present, else cpu; a clear error for a GPU that is not there."""
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
