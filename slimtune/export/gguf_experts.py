"""Per-expert Hugging Face tensors -> llama.cpp's stacked expert tensors (`blk.N.ffn_{gate,up,down}_exps`).

Mixture-of-experts checkpoints (Qwen3-MoE as transformers 5 saves it and as the Hub ships it) store every expert's
projections separately, `model.layers.N.mlp.experts.E.gate_proj.weight`; llama.cpp reads one 3-D tensor per layer
and projection, experts along the slowest dimension. `gguf`'s `TensorNameMap` names that tensor from the HF name
without the expert index (`...mlp.experts.gate_proj.weight` -> `blk.N.ffn_gate_exps`), so the converter looks the
stack up by that name and needs nothing per architecture here. A stack is read expert by expert into one array when
its turn comes: host memory holds one layer's stacked projection, never the model's experts.

gpt-oss checkpoints store each layer's experts fused, as transformers holds them (`<block>.gate_up_proj` [E, H, 2I]
for `x @ W`, gate and up interleaved by column, `<block>.down_proj` [E, I, H], and a bias for each); llama.cpp's
gpt-oss reads gate and up apart, each as [E, out, in] with its own bias (`fused_expert_parts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from slimtune.models.experts import expert_key


@dataclass(frozen=True)
class ExpertStack:
    """One layer's projection across its experts."""

    key: str  # the HF name without the expert index, the name gguf's TensorNameMap knows
    members: tuple[tuple[Path, str], ...]  # (safetensors file, stored key) of experts 0, 1, ...


def expert_stacks(tensors: Iterable[tuple[Path, str, str]], n_expert: int | None) -> dict[str, ExpertStack]:
    """Map each per-expert tensor's stored key to its stack; `tensors` are (file, stored key, HF key).

    Raises:
        ValueError: a stack misses experts, or has other than `n_expert` (the config's count, when known).
    """
    groups: dict[str, dict[int, tuple[Path, str]]] = {}
    for file, stored, key in tensors:
        if (expert := expert_key(key)) is not None:
            groups.setdefault(f"{expert.block}.{expert.tail}", {})[expert.expert] = (file, stored)
    stacks: dict[str, ExpertStack] = {}
    for key, members in groups.items():
        count = n_expert if n_expert is not None else max(members) + 1
        if sorted(members) != list(range(count)):
            raise ValueError(
                f"{key}: the checkpoint has {len(members)} experts (indices {min(members)}-{max(members)}), "
                f"the config {count}; the checkpoint is incomplete or from another config"
            )
        stack = ExpertStack(key, tuple(members[i] for i in range(count)))
        stacks.update((stored, stack) for _, stored in stack.members)
    return stacks


def stack_shape(stack: ExpertStack) -> tuple[int, ...]:
    """(n_expert, *expert shape) from the safetensors headers; every expert must have the same shape.

    Raises:
        ValueError: experts of one stack differ in shape.
    """
    from safetensors import safe_open

    shapes = set()
    with ExitStack() as files:
        handles = {file: files.enter_context(safe_open(file, framework="pt")) for file, _ in stack.members}
        for file, stored in stack.members:
            shapes.add(tuple(handles[file].get_slice(stored).get_shape()))
    if len(shapes) != 1:
        raise ValueError(f"{stack.key}: its experts have different shapes {sorted(shapes)}; they cannot be stacked")
    return (len(stack.members), *shapes.pop())


def stack_loader(
    stack: ExpertStack, shape: tuple[int, ...], transform: Callable[[np.ndarray], np.ndarray]
) -> Callable[[], np.ndarray]:
    """A loader of the stacked f32 array (`shape`), each expert transformed as a 2-D tensor of its own."""

    def load() -> np.ndarray:
        from safetensors import safe_open

        out = np.empty(shape, dtype=np.float32)  # one expert at a time: no list of per-expert copies
        with ExitStack() as files:
            handles = {file: files.enter_context(safe_open(file, framework="pt")) for file, _ in stack.members}
            for i, (file, stored) in enumerate(stack.members):
                out[i] = transform(handles[file].get_tensor(stored).float().numpy())
        return out

    return load


class FusedPart(NamedTuple):
    """One llama.cpp tensor cut from a fused gpt-oss expert tensor."""

    key: str  # the HF-style name gguf's TensorNameMap knows (`...mlp.experts.gate_proj.weight`)
    shape: tuple[int, ...]
    transform: Callable[[np.ndarray], np.ndarray]


def fused_expert_parts(key: str, shape: tuple[int, ...]) -> list[FusedPart] | None:
    """The llama.cpp tensors of a fused gpt-oss expert tensor, or None for any other tensor: gate_up's weight and
    bias split into gate (even columns) and up (odd columns), the weights transposed to llama.cpp's [E, out, in]."""
    block, _, name = key.rpartition(".")
    if not block.endswith(".experts") or name not in (
        "gate_up_proj",
        "gate_up_proj_bias",
        "down_proj",
        "down_proj_bias",
    ):
        return None
    bias = name.endswith("_bias")
    suffix = ".bias" if bias else ".weight"
    if name == "down_proj":
        return [FusedPart(f"{block}.down_proj{suffix}", (shape[0], shape[2], shape[1]), _transposed)]
    if name == "down_proj_bias":
        return [FusedPart(f"{block}.down_proj{suffix}", shape, lambda w: w)]
    half = (*shape[:-1], shape[-1] // 2)
    parts = []
    for proj, first in (("gate_proj", 0), ("up_proj", 1)):
        if bias:
            parts.append(
                FusedPart(f"{block}.{proj}{suffix}", half, lambda w, f=first: np.ascontiguousarray(w[..., f::2]))
            )
        else:
            shape_t = (shape[0], half[-1], shape[1])
            parts.append(FusedPart(f"{block}.{proj}{suffix}", shape_t, lambda w, f=first: _transposed(w[..., f::2])))
    return parts


def _transposed(w: np.ndarray) -> np.ndarray:
    """[E, in, out] (`x @ W`) -> [E, out, in], llama.cpp's expert matrices (its ne order is the reverse)."""
    return np.ascontiguousarray(w.transpose(0, 2, 1))
