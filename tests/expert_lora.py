"""What attach_lora adds beside peft on a mixture-of-experts family, for tests that build a LoRA model by hand."""

from __future__ import annotations

import torch

from slimtune.kernels.nf4_experts import NF4Experts, quantize_model_experts
from slimtune.models.families import FAMILIES
from slimtune.models.lora_targets import expert_lora_targets


def with_expert_lora(
    model: torch.nn.Module,
    family: str,
    targets: list[str],
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    random_b: torch.Generator | None = None,
) -> list[NF4Experts]:
    """An MoE model's experts in NF4 with LoRA on the MLP names among `targets`, as load_4bit and attach_lora
    make them; [] for a dense family. `random_b`: B drawn from it (x 0.05), so that the adapter is not zero."""
    if not FAMILIES[family].experts:
        return []
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    quantize_model_experts(model, dtype)
    blocks = [m for m in model.modules() if isinstance(m, NF4Experts)]
    for block in blocks:
        block.add_lora(r, alpha / r, expert_lora_targets(family, targets), dropout=dropout)
        if random_b is not None:
            for name in block.lora_projections():
                b = getattr(block, f"{name}_lora_B")
                b.data = torch.randn(b.shape, generator=random_b, dtype=b.dtype) * 0.05
    return blocks
