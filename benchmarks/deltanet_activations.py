#!/usr/bin/env python3
"""What one Gated DeltaNet layer and one attention layer of Qwen3.5 save for backward, per token (CPU, bf16).

A 4-layer model at Qwen3.5-4B's widths (three DeltaNet layers, one gated attention layer), random weights, the
projections trainable, one packed row of two documents through slimtune's packed DeltaNet forward
(`slimtune.train.step.linear_attention`, transformers' torch delta rule); saved-tensor hooks attribute each saved
storage to the decoder layer running. The figure behind `stored_layers: auto` storing no layer of these models
(docs/memory.md). Usage: python3 benchmarks/deltanet_activations.py  (~1 minute, ~6 GB of host memory)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL_SHAPES
from slimtune.train.options import choose_batching

TOKENS = 1024


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**MODEL_SHAPES["qwen35_4b"].config, "num_hidden_layers": 4, "vocab_size": 1024}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3_5_text", **config), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    choose_batching(model, "packed")
    for name, p in model.named_parameters():
        p.requires_grad_("layers" in name and "proj" in name)
    current, saved = [None], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is not None:
            saved.setdefault(current[0], {})[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None))
    positions = torch.cat([torch.arange(400), torch.arange(TOKENS - 400)]).unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 1000, (1, TOKENS)), position_ids=positions)
    for i, kind in enumerate(model.config.layer_types):
        print(f"layer {i} {kind}: {sum(saved[i].values()) / TOKENS / 1000:.0f} KB per token")


if __name__ == "__main__":
    main()
