"""What a stage needs, per resource: the `Estimate` that `slimtune.memory.estimate` makes and the guard checks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

_GIB = 1024**3
# The term of a GPU estimate that allows for the caching allocator's fragmentation (reserved beyond allocated)
FRAGMENTATION_TERM = "allocator fragmentation"


@dataclass(frozen=True)
class Estimate:
    """Bytes a stage needs, per resource, with the terms behind them and the spec field to change."""

    gpu_bytes: int
    host_bytes: int
    disk_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)
    # Part of gpu_bytes an earlier stage already holds on the device (the NF4 model during training).
    resident_gpu_bytes: int = 0
    # Part of gpu_bytes outside the caching allocator (the CUDA context and library workspaces).
    context_gpu_bytes: int = 0

    def top_terms(self, prefix: str, n: int = 3) -> str:
        """The largest `n` breakdown terms for one resource, in GiB, for error messages."""
        terms = sorted(
            ((k.removeprefix(prefix), v) for k, v in self.breakdown.items() if k.startswith(prefix)),
            key=lambda kv: -kv[1],
        )
        return ", ".join(f"{k} {v / _GIB:.2f} GiB" for k, v in terms[:n])

    def runs_in(self, free: int, need: int | None = None) -> bool:
        """Whether `need` (gpu_bytes by default) fits `free`, or is over by no more than the fragmentation allowance."""
        return (self.gpu_bytes if need is None else need) - self.allowance() <= free

    def tensors(self) -> Estimate:
        """This estimate less its fragmentation allowance: what must fit for the stage to run (`runs_in`)."""
        return replace(self, gpu_bytes=self.gpu_bytes - self.allowance())

    def allowance(self) -> int:
        """GPU bytes allowing for allocator fragmentation, not tensors: a capped allocator frees them from its cache."""
        return self.breakdown.get(f"gpu: {FRAGMENTATION_TERM}", 0)
