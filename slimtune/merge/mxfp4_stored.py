"""gpt-oss checkpoints whose experts are stored in MXFP4 (`<block>.gate_up_proj_blocks` / `_scales`, the released
ones): each pair stands for the 16-bit fused tensor `<block>.gate_up_proj` [E, in, out] it dequantizes to
(`slimtune.models.mxfp4`), read one expert matrix at a time. load_4bit quantizes that tensor to NF4; the merge
dequantizes it the same way, so its NF4 round trip gives the weights training used, and writes it in 16 bits.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from slimtune.models.mxfp4 import BLOCKS, GROUP, SCALES, dequantize_mxfp4

from .safetensors_io import NAMES, TensorEntry, as_tensor, read_raw

DTYPE = torch.bfloat16  # what transformers dequantizes gpt-oss's MXFP4 experts to, and the rest of it is stored in


def split_mxfp4(entries: list[TensorEntry]) -> tuple[list[TensorEntry], dict[str, dict[str, TensorEntry]]]:
    """Logical entries, each MXFP4 pair reported in its place as the bf16 [E, in, out] tensor it dequantizes to (its
    byte range the blocks', so only the shape and dtype are real), and per such tensor its two parts."""
    names = {e.name: e for e in entries}
    parts = {
        e.name.removesuffix(BLOCKS): {BLOCKS: e, SCALES: names[e.name.removesuffix(BLOCKS) + SCALES]}
        for e in entries
        if e.name.endswith(BLOCKS) and e.name.removesuffix(BLOCKS) + SCALES in names
    }
    logical = []
    for e in entries:
        name = e.name.removesuffix(BLOCKS) if e.name.endswith(BLOCKS) else e.name.removesuffix(SCALES)
        if name not in parts:
            logical.append(e)
        elif e.name.endswith(BLOCKS):
            experts, rows, groups, _ = e.shape
            logical.append(replace(e, name=name, dtype=NAMES[DTYPE], shape=(experts, groups * GROUP, rows)))
    return logical, parts


def dequantize_pair(
    parts: dict[str, TensorEntry], dtype: torch.dtype, device: torch.device | str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The [E, in, out] tensor an MXFP4 pair stands for, in `dtype` on `device` (into `out` when given), read and
    dequantized one expert matrix at a time."""
    blocks, scales = parts[BLOCKS], parts[SCALES]
    experts, rows, groups, _ = blocks.shape
    if out is None:
        out = torch.empty(experts, groups * GROUP, rows, dtype=dtype, device=device)
    for e, matrix in enumerate(out):
        b, s = expert_slice(blocks, e, experts), expert_slice(scales, e, experts)
        raw_b, raw_s = as_tensor(read_raw(b), b.dtype, b.shape), as_tensor(read_raw(s), s.dtype, s.shape)
        matrix.copy_(dequantize_mxfp4(raw_b.to(device), raw_s.to(device), dtype))
    return out


def expert_slice(entry: TensorEntry, e: int, num_experts: int) -> TensorEntry:
    """Expert `e`'s bytes of a stacked [E, ...] tensor (experts are its slowest dimension, so they are contiguous).

    Raises:
        ValueError: the tensor does not hold `num_experts` experts.
    """
    if entry.shape[0] != num_experts:
        raise ValueError(
            f"{entry.name} holds {entry.shape[0]} experts in {entry.file.name}; the config says {num_experts}"
        )
    size = entry.nbytes // num_experts
    return replace(entry, shape=entry.shape[1:], start=entry.start + e * size, end=entry.start + (e + 1) * size)
