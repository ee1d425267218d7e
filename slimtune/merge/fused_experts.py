"""LoRA saved per expert on a tensor the checkpoint stores fused: gpt-oss's `<block>.gate_up_proj` [E, in, out].

The adapter holds expert e's factors as `<block>.<e>.gate_up_proj` (`slimtune.kernels.nf4_experts.
expert_lora_checkpoint`), as peft would save LoRA on per-expert linears; the checkpoint has no such tensor, only the
stack of all experts' matrices in `x @ W` orientation. Here a block's per-expert factors become one 3-D factor on
that stack (`LoraFactor` with leading expert dimension, transposed), so the tensor-by-tensor merge adds every expert's
delta in one pass over the stored tensor.
"""

from __future__ import annotations

import torch

from slimtune.models.experts import expert_key

from .errors import AdapterMismatchError
from .lora_delta import Adapter, LoraFactor
from .safetensors_io import TensorEntry


def stack_fused_experts(adapter: Adapter, base: dict[str, TensorEntry]) -> Adapter:
    """`adapter` with each per-expert factor whose target the base stores only as a 3-D stack moved onto that stack;
    every other factor is kept as it is (the base's own per-expert tensors, Qwen3-MoE's, are not touched).

    Raises:
        AdapterMismatchError: a stack's experts are not all in the adapter, or they differ in scale.
    """
    lora: dict[str, LoraFactor] = {}
    stacks: dict[str, dict[int, LoraFactor]] = {}
    for name, factor in adapter.lora.items():
        key = expert_key(name)
        stack = f"{key.block}.{key.tail.removesuffix('.weight')}" if key else ""
        if key is None or name in base or stack not in base or len(base[stack].shape) != 3:
            lora[name] = factor
        else:
            stacks.setdefault(stack, {})[key.expert] = factor
    for stack, experts in stacks.items():
        count = base[stack].shape[0]
        if sorted(experts) != list(range(count)):
            raise AdapterMismatchError(
                f"the adapter has LoRA on {len(experts)} of the {count} experts of {stack}; an expert LoRA is saved "
                "for every expert (was the adapter file cut or edited?)"
            )
        factors = [experts[e] for e in range(count)]
        if len({f.scale for f in factors}) != 1:
            raise AdapterMismatchError(f"{stack}: its experts' LoRA factors have different scales (alpha_pattern?)")
        a, b = torch.stack([f.a for f in factors]), torch.stack([f.b for f in factors])
        lora[stack] = LoraFactor(a, b, factors[0].scale, transpose=True)  # stored [E, in, out]: (B A)^T per expert
    return Adapter(lora, adapter.replacements)
