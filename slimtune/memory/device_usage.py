"""What this process holds on a GPU, device-wide: the figure a card size is compared with.

The caching allocator sees only its own blocks. A process also holds the CUDA context, cuBLAS/cuDNN
handles and workspaces and the loaded kernel modules (0.79-0.82 GiB measured while training, see
`slimtune.memory.estimate`), so a run whose allocator reserved 4.55 GiB held 5.34 GiB of the card.
NVML reports each process's usage; inside a container its process ids are the host's and this
process is not found by its id: where NVML lists one process on the device and this one holds a context there,
that one is this process; otherwise the device's whole used memory stands in (other processes included).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from slimtune.memory.estimate import CUDA_CONTEXT_BYTES


def _nvml_handle(device: torch.device):
    """The NVML handle of `device` (matched by UUID: CUDA_VISIBLE_DEVICES renumbers), or None without NVML."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except (pynvml.NVMLError, RuntimeError, AttributeError):
        return None


def process_reader(device: torch.device) -> Callable[[], int | None] | None:
    """A callable giving this process's bytes on `device` (None when NVML cannot tell it from the others),
    or None when there is no CUDA device or no NVML."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    handle = _nvml_handle(device)
    if handle is None:
        return None
    import pynvml

    pid = os.getpid()

    def used() -> int | None:
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError:
            return None
        return held_by_this_process(procs, pid, holds_context=torch.cuda.memory_reserved(device) > 0)

    return used


def held_by_this_process(procs: list, pid: int, holds_context: bool) -> int | None:
    """This process's bytes among NVML's compute processes of a device (objects with `pid`, `usedGpuMemory`).

    Its own entry; in a container, where NVML gives the host's process ids, the one entry there is when this
    process holds a context on the device (it has memory there): no other process does. None where it is unknown.
    """
    mine = next((p.usedGpuMemory for p in procs if p.pid == pid), None)
    if mine is None and holds_context and len(procs) == 1:
        mine = procs[0].usedGpuMemory
    return mine


def device_reader(device: torch.device) -> Callable[[], int] | None:
    """A callable giving the device's used bytes (every process), or None without a CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lambda: (lambda free, total: total - free)(*torch.cuda.mem_get_info(device))


# What a training step still loads outside the allocator after its model is in place (libraries load lazily: cuBLAS
# at the first matmul, its workspace per stream and thread, Triton modules at their first launch). This process
# held 0.13 GiB more outside its allocator while training than at attach_lora on an H100 (8B, 0.66 -> 0.79 GiB:
# benchmarks/results/memory/h100-2026-11-28-8b-6gib-whole-flow.json) and 0.12 GiB more on an H200 (1B, 0.67 ->
# 0.79: benchmarks/results/user/h200-2026-11-28-1b.json).
_LAZY_LIBRARIES = int(0.15 * 1024**3)


def outside_allocator_bytes(device: torch.device) -> int:
    """What this process holds on `device` outside the caching allocator, with what a training step loads later
    (`_LAZY_LIBRARIES`): measured where NVML tells this process apart; where it cannot, the smaller of the
    calibrated context and what the device holds beyond this process's allocator (an upper bound of its share).

    Measured, not the calibrated figure, because cards, drivers and libraries differ.
    """
    reader = process_reader(device)
    held = reader() if reader is not None else None
    reserved = torch.cuda.memory_reserved(device)
    if held is None:
        # NVML cannot tell this process apart (a container that lists no process): what the whole device holds
        # bounds its share from above, and the calibrated context where that bound is the larger (other processes)
        free, total = torch.cuda.mem_get_info(device)
        return min(CUDA_CONTEXT_BYTES, total - free - reserved + _LAZY_LIBRARIES)
    return held - reserved + _LAZY_LIBRARIES
