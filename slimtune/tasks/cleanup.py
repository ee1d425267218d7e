"""cleanup: free every live model and cache, and check that memory is back to its baseline."""

from __future__ import annotations

import logging
import weakref
from dataclasses import asdict, dataclass, field

import psutil
import torch

from slimtune.core import registry
from slimtune.kernels.scratch import release_scratch
from slimtune.memory import clean_memory
from slimtune.memory.holders import holder_chains, live_tensors

log = logging.getLogger(__name__)
# After freeing the models only the CUDA context and allocator bookkeeping should remain; 64 MiB is the
# tolerance the memory-guard issue sets for "back to baseline".
BASELINE_TOLERANCE_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory in use at one moment: GPU allocated by torch (None without CUDA) and host RSS."""

    gpu_allocated: int | None
    host_rss: int

    @classmethod
    def take(cls) -> MemorySnapshot:
        gpu = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
        return cls(gpu_allocated=gpu, host_rss=psutil.Process().memory_info().rss)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CleanupResult:
    """What was released and how far GPU memory is from where the run started."""

    released: list[str]
    before: dict
    after: dict
    gpu_excess_bytes: int | None
    back_to_baseline: bool
    # handle -> what still references the released object (`holder_chains`); empty when everything was freed
    survivors: dict[str, list[str]] = field(default_factory=dict)
    # Only when GPU memory is off baseline: the bytes of CUDA tensors Python still reaches (the rest of the excess
    # is held outside Python), and the largest of them with their holders.
    gpu_reachable_bytes: int | None = None
    largest_gpu_tensors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def cleanup(baseline: dict) -> CleanupResult:
    """Release every registered object, clear caches, and compare GPU memory with `baseline`.

    Args:
        baseline: `MemorySnapshot.to_dict()` taken before load_4bit.
    """
    before = MemorySnapshot.take()
    watched = _weak_refs()
    released = registry.release_all()
    # The NF4 kernel's dequantization scratch (the largest weight of the model, e.g. 112 MiB for an 8B)
    # is module state, not model state: it goes with the models.
    clean_memory(release=[release_scratch])
    after = MemorySnapshot.take()
    survivors = {handle: holder_chains(ref()) for handle, ref in watched.items() if ref() is not None}
    for handle, chains in survivors.items():
        log.warning("%s is still alive after cleanup; held by:\n  %s", handle, "\n  ".join(chains) or "?")
    excess = reachable = None
    largest: list[str] = []
    ok = True
    if after.gpu_allocated is not None and baseline.get("gpu_allocated") is not None:
        excess = after.gpu_allocated - baseline["gpu_allocated"]
        ok = excess <= BASELINE_TOLERANCE_BYTES
        if not ok:
            reachable, largest = live_tensors("cuda")
            log.warning(
                "GPU memory is %.1f MiB above its value before load_4bit after cleanup; something still references "
                "a model tensor. CUDA tensors Python reaches: %.1f MiB; the largest:\n  %s",
                excess / 2**20,
                reachable / 2**20,
                "\n  ".join(largest) or "none",
            )
    log.info("released %s; GPU allocated %s -> %s bytes", released, before.gpu_allocated, after.gpu_allocated)
    return CleanupResult(
        released=released,
        before=before.to_dict(),
        after=after.to_dict(),
        gpu_excess_bytes=excess,
        back_to_baseline=ok,
        survivors=survivors,
        gpu_reachable_bytes=reachable,
        largest_gpu_tensors=largest,
    )


def _weak_refs() -> dict[str, weakref.ref]:
    """Weak references to the registered objects that allow them (models, patches; not tuples or dicts)."""
    refs = {}
    for handle in registry.handles():
        try:
            refs[handle] = weakref.ref(registry.get(handle))
        except TypeError:
            continue
    return refs
