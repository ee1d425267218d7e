"""Train-free adapters for merge tests: the product's load and attach, with LoRA B random instead of trained."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from slimtune.core import registry
from slimtune.spec.schema import PipelineSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.dequant_merge import dequant_merge
from slimtune.tasks.load_4bit import LoadResult, load_4bit


def merge_random_adapter(
    spec: PipelineSpec, adapter: Path, inspect: Callable[[LoadResult], None] | None = None
) -> Path:
    """load_4bit, attach_lora with a seeded random non-zero B standing in for training, saved to `adapter`, and
    dequant_merge; `inspect` sees the load's result first. Returns the merged folder."""
    try:
        loaded = load_4bit(spec)
        if inspect is not None:
            inspect(loaded)
        peft_model = registry.get(attach_lora(spec, loaded.handle).handle)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        peft_model.save_pretrained(adapter)
    finally:
        registry.release_all()
    return Path(dequant_merge(spec, str(adapter), maximum_memory_usage=0.5).out_dir)
