"""Free what Python and the CUDA caching allocator still hold between stages."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import torch


def clean_memory(passes: int = 3, *, release: Iterable[Callable[[], None]] = ()) -> int:
    """Collect garbage and return cached CUDA blocks, up to `passes` times, then reset peak stats.

    Several passes because one `gc.collect()` can only free what is unreachable now: objects whose
    finalizers drop the last reference to other cycles (hooks, peft wrappers, optimizer state) become
    collectable on the next pass, and `empty_cache` can only return blocks freed before it runs. A pass
    that finds nothing ran no finalizer, so the next would find nothing either: it ends the loop. A full
    collection walks every tracked object (~0.4 s with torch, transformers and Prefect loaded), and the
    guard cleans before each stage: a tiny CPU run spent 16 of its 26 s in 40 passes, 24 of which found
    nothing.

    Args:
        release: frees module-level state the caller knows of (the kernels' scratch buffers, which
            `cleanup` passes: `slimtune.kernels.scratch.release_scratch`), called before collecting.

    Returns:
        Bytes still allocated by torch on the current CUDA device afterwards (0 without CUDA), so
        callers can compare with a baseline.
    """
    for free in release:
        free()
    # Skipping uninitialised CUDA avoids creating a ~500 MiB context just to clean it.
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(passes):
        found = gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.ipc_collect()
        if not found:
            break
    if not cuda:
        return 0
    # without this, "back to baseline" after cleanup is off by the workspaces
    drop_cublas_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def drop_cublas_workspaces() -> None:
    """Free the workspaces cuBLAS takes from the caching allocator, one per (thread, stream) that ran a matmul
    (32 MiB each on an H100) and kept until told: the next matmul makes its own again."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()
