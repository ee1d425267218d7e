"""A frozen input-embedding table kept in pinned host memory, its rows gathered by the GPU over the bus.

Why: when LoRA does not train the embeddings, the table is only ever read at the rows of this
batch's tokens, yet it is the largest single weight on the GPU: vocab 128256 x hidden 4096 in bf16 is
0.98 GiB for Llama-3.1-8B, 18% of its NF4 footprint. In pinned host memory it costs no GPU memory;
a Triton kernel reads the batch's rows straight from it (pinned memory is mapped into the GPU's
address space under unified addressing), 64 MiB for 4 x 2048 tokens of an 8B model: ~2 ms over
PCIe 5, with no host sync and no host-side gather.

Not for an embedding that is trained or tied to the output head (the head needs the table on the
GPU for every token); `apply_kernels` skips those with the reason.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # columns per loop iteration: a 4096-wide bf16 row in 4 iterations of 2 KiB


@triton.jit
def _gather_rows_kernel(table_ptr, ids_ptr, out_ptr, dim, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.load(ids_ptr + row).to(tl.int64)
    for start in range(0, dim, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < dim
        tl.store(out_ptr + row * dim + cols, tl.load(table_ptr + idx * dim + cols, mask=mask), mask=mask)


def to_host(weight: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `weight` (plain host memory when it is already on the CPU); `weight` itself when it is
    pinned already (load_4bit read it there: `slimtune.tasks.load_tables`)."""
    if weight.is_pinned():
        return weight
    return torch.empty(weight.shape, dtype=weight.dtype, pin_memory=weight.is_cuda).copy_(weight)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`table[ids]` on `ids.device`, reading the rows of a (pinned host) table in place.

    Args:
        table: [vocab, dim] contiguous, in pinned host memory (or on the CPU under TRITON_INTERPRET).
        ids: integer token ids of any shape, on the GPU; every id must be < vocab (as for nn.Embedding,
            an out-of-range id is a caller bug: here it reads outside the table).
    """
    if not table.is_contiguous():
        raise ValueError("gather_rows: the embedding table must be contiguous")
    out = torch.empty(*ids.shape, table.shape[1], dtype=table.dtype, device=ids.device)
    flat = ids.reshape(-1)
    if flat.numel():
        _gather_rows_kernel[(flat.numel(),)](table, flat, out, table.shape[1], BLOCK=_BLOCK, num_warps=4)
    return out


def reference_gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What nn.Embedding computes: the rows, gathered on the table's device and moved to the ids'."""
    return torch.nn.functional.embedding(ids.to(table.device), table).to(ids.device)
