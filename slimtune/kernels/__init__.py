"""Triton kernels for QLoRA training and their per-instance patching of Hugging Face models.

Only the selection/patching API is imported eagerly. Kernel modules are imported on first use, so
that `TRITON_INTERPRET=1` (needed on CPU, read by Triton when a kernel is decorated) can still be set
after `import slimtune.kernels`.
"""

from ._launch import compute_device
from .apply import KERNEL_NAMES, apply_kernels, resolve_selection
from .instance_patch import KernelPatch

__all__ = [
    "KERNEL_NAMES",
    "KernelPatch",
    "apply_kernels",
    "compute_device",
    "fused_linear_cross_entropy",
    "resolve_selection",
]


def __getattr__(name: str):
    if name == "fused_linear_cross_entropy":
        from .fused_linear_ce import fused_linear_cross_entropy

        return fused_linear_cross_entropy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
