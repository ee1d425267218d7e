"""load_4bit's mixture-of-experts weights: read from the shards and quantized one layer at a time.

bitsandbytes quantizes 2-D linears only, so `from_pretrained` would put every fused 3-D expert tensor on the
device in 16 bits before `quantize_model_experts` replaced it: 54 GiB at once for Qwen3-30B-A3B, which no 24 GiB
card holds. Here the family's class is built without those tensors (`without_dense_experts`), so
`from_pretrained` reads none of them, and `load_nf4_experts` assembles one layer's fused tensors on the device from
the checkpoint's per-expert tensors, quantizes them into `NF4Experts` and drops them before the next layer: the
device holds one layer's experts in 16 bits at most (1.1 GiB for Qwen3-30B-A3B, and ~1.1 GiB of temporaries while
quantizing them), the host one expert matrix. gpt-oss checkpoints store each layer's fused tensors as the model holds
them (`FUSED_STORED`), in 16 bits or in MXFP4 (`slimtune.models.mxfp4`); those are read expert by expert too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from slimtune.kernels.nf4_experts import NF4Experts, expert_blocks
from slimtune.merge.mxfp4_stored import dequantize_pair, expert_slice
from slimtune.merge.safetensors_io import TensorEntry, as_tensor, checkpoint_shards, read_entries, read_raw
from slimtune.models.experts import FUSED_STORED, HELD, per_expert_name
from slimtune.models.mxfp4 import BLOCKS, SCALES

_Model = TypeVar("_Model", bound=nn.Module)


def fused_names(model: nn.Module) -> set[str]:
    """The fused expert parameters (`<block>.gate_up_proj`, `<block>.down_proj`, and their MXFP4 blocks and scales)
    that `load_nf4_experts` loads: the checkpoint keys `from_pretrained` reports as unexpected when the model was
    built by `without_dense_experts`."""
    fused = {f"{block}.{projection}_proj" for block, _ in expert_blocks(model) for projection in HELD}
    return fused | {name + suffix for name in fused for suffix in (BLOCKS, SCALES)}


def without_dense_experts(cls: type[_Model]) -> type[_Model]:
    """`cls` whose experts modules are built without their fused 3-D weights, for one `from_pretrained` call.

    A subclass, not a patch of `cls`: it differs only in construction, and the instance it builds is a `cls`
    again as soon as it is built (`from_pretrained` then loads everything else into it as usual).
    """

    class WithoutDenseExperts(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            for _, module in expert_blocks(self):
                for projection in HELD:
                    setattr(module, f"{projection}_proj", None)  # out of the state dict: nothing to load or place
                module._is_hf_initialized = True  # else transformers' init of unloaded weights would fill these
            self.__class__ = cls  # transformers' own class from here on (a subclass would count as custom code)

    return WithoutDenseExperts


def load_nf4_experts(
    model: nn.Module,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    on_dense: Callable[[torch.Tensor], None] | None = None,
) -> int:
    """Quantize each experts module of `model` (built by `without_dense_experts`) from the checkpoint, one layer
    at a time, into `NF4Experts` on `device`; returns how many. The fused tensors are exactly what transformers
    loads (its Qwen2-MoE conversion: experts stacked, each one's gate rows then up rows; cast to `dtype`), so the
    NF4 bytes equal those of `quantize_model_experts` after a plain `from_pretrained`.

    Args:
        on_dense: called with each 16-bit fused tensor as it is materialized (tests measure the bound with it).

    Raises:
        FileNotFoundError: an expert matrix is in no safetensors shard of `model_dir` (checked before any is read).
    """
    blocks = expert_blocks(model)
    entries = {e.name: e for shard in checkpoint_shards(model_dir) for e in read_entries(shard)} if blocks else {}
    missing = [name for block, m in blocks for name in _stored_names(block, m) if not _present(name, entries)]
    if missing:
        raise FileNotFoundError(
            f"{model_dir}: {missing[0]} is in none of its safetensors shards ({len(missing)} expert matrices missing); "
            "model.name_or_path needs the whole checkpoint"
        )
    for block, module in blocks:
        parent, _, child = block.rpartition(".")
        setattr(model.get_submodule(parent), child, _quantized_block(block, module, entries, dtype, device, on_dense))
    return len(blocks)


def _quantized_block(
    block: str,
    module: nn.Module,
    entries: dict[str, TensorEntry],
    dtype: torch.dtype,
    device: torch.device,
    on_dense: Callable[[torch.Tensor], None] | None,
) -> NF4Experts:
    """One layer: its fused tensors on the device, then NF4; they are freed when this returns (no caller holds
    them), before the next layer's are read."""
    for projection, held in HELD.items():
        if type(module).__name__ in FUSED_STORED:
            fused = _stored_fused(f"{block}.{projection}_proj", module.num_experts, entries, dtype, device)
        else:
            fused = _fused(block, module.num_experts, held, entries, dtype, device)
        if on_dense is not None:
            on_dense(fused)
        setattr(module, f"{projection}_proj", nn.Parameter(fused, requires_grad=False))
    return NF4Experts.from_experts(module, dtype)  # drops the module's fused parameters


def _stored_names(block: str, module: nn.Module) -> list[str]:
    """The checkpoint keys a block's experts are read from: per expert (Qwen3-MoE), or the fused tensors as stored
    (gpt-oss), in 16 bits or as their MXFP4 pair (`_present`)."""
    if type(module).__name__ not in FUSED_STORED:
        return [name for held in HELD.values() for row in _names(block, module.num_experts, held) for name in row]
    return [f"{block}.{projection}_proj" for projection in HELD]


def _present(name: str, entries: dict[str, TensorEntry]) -> bool:
    """The tensor `name` is in the checkpoint, or both its MXFP4 tensors are."""
    return name in entries or all(name + suffix in entries for suffix in (BLOCKS, SCALES))


def _names(block: str, num_experts: int, held: tuple[str, ...]) -> list[list[str]]:
    """The checkpoint keys of one fused projection: per expert, its `held` matrices in row order."""
    return [[per_expert_name(block, e, p) for p in held] for e in range(num_experts)]


def _fused(
    block: str,
    num_experts: int,
    held: tuple[str, ...],
    entries: dict[str, TensorEntry],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """[E, rows, in]: expert e's `held` matrices stacked by rows, read one at a time into a device tensor."""
    names = _names(block, num_experts, held)
    rows = [entries[n].shape[0] for n in names[0]]
    out = torch.empty(num_experts, sum(rows), entries[names[0][0]].shape[1], dtype=dtype, device=device)
    for e, row in enumerate(names):
        for part, name in zip(out[e].split(rows), row):
            entry = entries[name]
            part.copy_(as_tensor(read_raw(entry), entry.dtype, entry.shape))  # cast as from_pretrained's `.to`
    return out


def _stored_fused(
    name: str, num_experts: int, entries: dict[str, TensorEntry], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A fused tensor stored as the model holds it ([E, in, out]), read one expert matrix at a time into a device
    tensor: its 16-bit bytes, or its MXFP4 blocks and scales dequantized (`slimtune.merge.mxfp4_stored`)."""
    if name not in entries:
        return dequantize_pair({s: entries[name + s] for s in (BLOCKS, SCALES)}, dtype, device)
    entry = entries[name]
    out = torch.empty(entry.shape, dtype=dtype, device=device)
    for e, part in enumerate(out):
        expert = expert_slice(entry, e, num_experts)
        part.copy_(as_tensor(read_raw(expert), expert.dtype, expert.shape))
    return out
