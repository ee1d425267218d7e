"""Typed memory errors and the classifier that decides which failures are worth a downshifted retry.

Only memory failures are retried: a smaller micro-batch cannot fix a shape mismatch, so every
other error fails once with its own message.
"""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass

import psutil
import torch

from slimtune.core.exception_chain import exception_chain

_GIB = 1024**3

# RuntimeError texts raised by the CUDA caching allocator, cuBLAS/cuDNN workspace allocation and
# the CPU allocator ("DefaultCPUAllocator: can't allocate memory", verified on torch 2.13).
_MEMORY_TEXTS = (
    "cuda out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "cudnn_status_alloc_failed",
    "out of memory",
    "can't allocate memory",
)
# A shell reports a child killed by SIGKILL as 128 + 9.
_SIGKILL_CODES = (-signal.SIGKILL, 128 + signal.SIGKILL)


@dataclass(frozen=True)
class MemoryState:
    """What memory looked like when a stage failed; every field in bytes, None where unknown."""

    device: str
    gpu_allocated: int | None
    gpu_reserved: int | None
    gpu_free: int | None
    gpu_total: int | None
    host_available: int
    host_rss: int

    def describe(self) -> str:
        """One line for logs and error messages, in GiB."""
        parts = [f"device {self.device}"]
        for name in ("gpu_allocated", "gpu_reserved", "gpu_free", "gpu_total"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name.replace('_', ' ')} {value / _GIB:.2f} GiB")
        parts.append(f"host available {self.host_available / _GIB:.2f} GiB")
        parts.append(f"host RSS {self.host_rss / _GIB:.2f} GiB")
        return ", ".join(parts)


def memory_state(device: str) -> MemoryState:
    """Snapshot the allocator, device and host memory without initialising CUDA needlessly."""
    dev = torch.device(device)
    allocated = reserved = free = total = None
    if dev.type == "cuda" and torch.cuda.is_available():
        allocated = torch.cuda.memory_allocated(dev)
        reserved = torch.cuda.memory_reserved(dev)
        free, total = torch.cuda.mem_get_info(dev)
    return MemoryState(
        device=str(dev),
        gpu_allocated=allocated,
        gpu_reserved=reserved,
        gpu_free=free,
        gpu_total=total,
        host_available=psutil.virtual_memory().available,
        host_rss=psutil.Process().memory_info().rss,
    )


class MemoryPressure(RuntimeError):
    """A stage ran out of memory; retried with a downshifted setting by `retry_on_memory_pressure`."""

    def __init__(self, stage: str, state: MemoryState, reason: str) -> None:
        super().__init__(f"{stage} ran out of memory ({reason}); state: {state.describe()}")
        self.stage = stage
        self.state = state
        self.reason = reason
        # The guard attaches its GuardRecord so a caller catching the error can publish it.
        self.record: object | None = None

    def __reduce__(self):
        # Prefect may pickle a failed task's exception into its result store; keep the fields.
        return (MemoryPressure, (self.stage, self.state, self.reason))


class PreflightError(RuntimeError):
    """The estimate exceeds what is free; raised before anything is allocated and never retried."""


def _is_bnb_paged_alloc_failure(exc: BaseException) -> bool:
    # bitsandbytes 0.50 allocates its tensors through torch (so CUDA failures arrive as
    # torch.OutOfMemoryError); its one native allocation, `get_paged` for paged optimizer state,
    # hands numpy a NULL pointer when cudaMallocManaged fails, which surfaces as this ValueError.
    if not isinstance(exc, ValueError) or "NULL pointer access" not in str(exc):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any("bitsandbytes" in f.filename and f.name == "get_paged" for f in frames)


def _is_memory_error(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError, MemoryPressure)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(t in text for t in _MEMORY_TEXTS)
    if getattr(exc, "returncode", None) in _SIGKILL_CODES:
        # subprocess.CalledProcessError (or a ChildProcessError carrying `returncode`) from a child,
        # e.g. llama.cpp quantize, that the kernel OOM-killed.
        return True
    return _is_bnb_paged_alloc_failure(exc)


def classify(exc: BaseException) -> bool:
    """True when `exc`, or an exception it was raised from, is a memory failure.

    The explicit `__cause__` chain is followed because loaders often re-raise an allocation
    failure as their own error (`raise LoadError(...) from oom`).
    """
    return any(_is_memory_error(e) for e in exception_chain(exc, implicit=False))


def to_memory_pressure(exc: BaseException, stage: str, state: MemoryState) -> MemoryPressure:
    """Wrap a classified memory failure; the caller raises it `from exc` to keep the original."""
    if isinstance(exc, MemoryPressure):
        return exc
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    reason = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    return MemoryPressure(stage, state, reason)
