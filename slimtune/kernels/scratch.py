"""Scratch buffers the kernels reuse across calls, and the call that frees them.

Module state, not model state: they outlive the model unless freed, so `cleanup` frees them with the
models (`clean_memory(release=...)`). Kept apart from the kernels so that freeing imports no Triton.
"""

from __future__ import annotations

import torch

# (device, dtype) -> one flat buffer, grown to the largest request (e.g. the NF4 dequantization of a weight)
BUFFERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# (device, dtype) -> weight shape -> views of that buffer (see `nf4.dequantize_nf4_scratch`)
VIEWS: dict[tuple[torch.device, torch.dtype], dict[tuple[int, ...], tuple[torch.Tensor, ...]]] = {}


def release_scratch() -> None:
    """Free the scratch buffers (e.g. before merging, when the training step's memory is given back)."""
    VIEWS.clear()  # first: the views hold the buffers too
    BUFFERS.clear()
