"""Where a mixture-of-experts checkpoint keeps its experts, and where transformers 5 puts them.

Qwen3-MoE checkpoints (the Hub's, and what transformers 5's save_pretrained writes) store each expert
matrix under its own key, `<block>.<e>.{gate,up,down}_proj.weight` with `<block>` a layer's `mlp.experts`.
transformers 5 loads them fused into two 3-D parameters per layer: `<block>.gate_up_proj` [E, 2I, H] (each
expert's gate rows, then its up rows) and `<block>.down_proj` [E, H, I]. The checks compare the stored
tensors with the fused model, the adapter is saved per expert (as peft would save LoRA on per-expert
linears, so the merge applies it like any other LoRA), and the GGUF stacks them again. gpt-oss checkpoints store
the fused tensors themselves (`FUSED_STORED`); their adapter is saved per expert of the fused tensor
(`<block>.<e>.gate_up_proj`), which the merge stacks back onto it (`slimtune.merge.fused_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

# transformers 5's fused experts modules that `slimtune.kernels.nf4_experts.NF4Experts` replaces
EXPERT_CLASSES = ("Qwen3MoeExperts", "GptOssExperts")
# Those whose checkpoints store the fused tensors as the model holds them: gpt-oss's `<block>.gate_up_proj`
# [E, H, 2I] (`x @ W`, gate and up interleaved by column), `<block>.down_proj` [E, I, H] and their biases; the
# released ones in MXFP4 (`<block>.gate_up_proj_blocks` / `_scales`, `slimtune.models.mxfp4`).
FUSED_STORED = ("GptOssExperts",)
PER_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<tail>.+)$")
# each fused projection (`<block>.<name>_proj`) -> the stored projections it holds, in row order
HELD = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class ExpertKey(NamedTuple):
    block: str  # e.g. model.layers.0.mlp.experts
    expert: int
    tail: str  # e.g. gate_proj.weight


def expert_count(config: dict) -> int:
    """Experts per layer: the Hub's Qwen3-MoE config.json says `num_experts`; transformers 5 saves
    `num_local_experts`."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def expert_key(name: str) -> ExpertKey | None:
    """The block, expert and rest of a per-expert checkpoint key; None for any other tensor."""
    m = PER_EXPERT.match(name)
    return ExpertKey(m["block"], int(m["expert"]), m["tail"]) if m else None


def per_expert_name(block: str, expert: int, proj: str) -> str:
    """The checkpoint key of one expert's projection (the inverse of `expert_key`)."""
    return f"{block}.{expert}.{proj}.weight"


def per_expert_lora_key(block: str, expert: int, proj: str, half: str) -> str:
    """peft's adapter-file key of one LoRA factor on one expert's projection, as if experts were linears."""
    return f"{block}.{expert}.{proj}.lora_{half}.weight"


def fused_shapes(stored: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """The fused parameters' shapes (`<block>.gate_up_proj`, `<block>.down_proj`) that per-expert tensors make.

    A block's experts are counted as stored (the highest index + 1: a missing expert then shows as a shape that
    disagrees with the config); gate and up each give half of gate_up's rows.
    """
    experts: dict[str, int] = {}
    shapes: dict[tuple[str, str], tuple[int, ...]] = {}
    for name, shape in stored:
        key = expert_key(name)
        if key is None or not key.tail.endswith(".weight"):
            continue
        experts[key.block] = max(experts.get(key.block, 0), key.expert + 1)
        shapes.setdefault((key.block, key.tail.removesuffix(".weight")), tuple(shape))
    fused = {}
    for block, count in experts.items():
        for projection, held in HELD.items():
            parts = [shapes.get((block, p)) for p in held]
            if all(parts):  # the held matrices stacked by rows: gate's, then up's
                fused[f"{block}.{projection}_proj"] = (count, sum(p[0] for p in parts), *parts[0][1:])
    return fused


def stored_projections(class_name: str) -> dict[str, tuple[str, ...]]:
    """Each fused projection of an experts class -> the names its expert LoRA is saved under, in row order: the
    checkpoint's per-expert projections (Qwen3-MoE: gate_proj, up_proj), or the fused one itself (gpt-oss)."""
    if class_name in FUSED_STORED:
        return {projection: (f"{projection}_proj",) for projection in HELD}
    return HELD
