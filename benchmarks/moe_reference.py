#!/usr/bin/env python3
"""The bf16-expert reference of a mixture-of-experts run: the same spec through slimtune's own task functions, with
every layer's experts held in bf16 instead of NF4.

Issue 43 asks that QLoRA with NF4 experts train like 16-bit experts from the same init (loss within 1% over 20
steps). Everything but the experts' storage is the product's: load_4bit (attention and the rest as `slimtune run`
loads them), attach_lora (seeded by the spec: the same LoRA init), the same tokenized data and steps. Between the two,
each `NF4Experts`' NF4 matrices are replaced by the checkpoint's own bf16 matrices (`DenseExpertWeights`), which its
forward and backward read the same way; nothing else changes.

Usage (user_compare.py's `bf16_experts` row runs it): python3 benchmarks/moe_reference.py --spec SPEC.json --out R.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `benchmarks`, `slimtune`

from benchmarks.common import gib, write_json_atomic

SUFFIX = "-bf16-experts"  # the reference's run name: its own run directory beside the product run's


class DenseExpertWeights(nn.Module):
    """E matrices of one shape held as they are: what `NF4Experts` reads of its NF4 storage (`num_experts`,
    `shape`, `dtype`, the device of `packed`, `dequantize_experts`), with no quantization in between."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.shape = tuple(weight.shape[1:])
        self.dtype = weight.dtype

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def packed(self) -> torch.Tensor:  # NF4Experts places its LoRA on this tensor's device
        return self.weight

    def dequantize_experts(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight[start:stop].to(dtype or self.dtype)


def _checkpoint_tensors(model_dir: Path, stack: contextlib.ExitStack) -> dict:
    """name -> the open shard that holds it (`get_tensor(name)` reads it to the CPU), each shard opened once for
    as long as `stack` lives: a Qwen3-30B-A3B checkpoint has 18,432 expert matrices."""
    from safetensors import safe_open

    shards = [stack.enter_context(safe_open(str(p), framework="pt")) for p in sorted(model_dir.glob("*.safetensors"))]
    return {name: shard for shard in shards for name in shard.keys()}


def dense_experts(model: nn.Module, model_dir: Path, dtype: torch.dtype) -> int:
    """Swap each `NF4Experts`' NF4 matrices for the checkpoint's 16-bit ones, fused as transformers fuses them (Qwen3-
    MoE: each expert's gate rows then up rows; gpt-oss: the stored tensors as they are); returns how many layers."""
    from slimtune.kernels.nf4_experts import NF4Experts
    from slimtune.models.experts import HELD, per_expert_name

    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, NF4Experts)]
    with contextlib.ExitStack() as stack:
        shards = _checkpoint_tensors(model_dir, stack)

        def read(name: str) -> torch.Tensor:
            return shards[name].get_tensor(name)

        for block, module in blocks:
            device = module.gate_up.packed.device
            for projection, held in HELD.items():
                if module.transposed:  # gpt-oss keeps `<block>.gate_up_proj` [E, H, 2I] and `<block>.down_proj`
                    fused = read(f"{block}.{projection}_proj")
                else:
                    experts = range(module.num_experts)
                    fused = torch.stack(
                        [torch.cat([read(per_expert_name(block, e, p)) for p in held]) for e in experts]
                    )
                setattr(module, projection, DenseExpertWeights(fused.to(device=device, dtype=dtype)))
    return len(blocks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True, help="the JSON spec the product run used")
    p.add_argument("--out", required=True, help="result JSON")
    args = p.parse_args(argv)

    from slimtune.core import registry
    from slimtune.core.device import prefer_expandable_segments

    prefer_expandable_segments()  # as the product's resolve_device, before CUDA is touched
    from slimtune.spec.schema import parse_spec
    from slimtune.tasks.attach_lora import attach_lora
    from slimtune.tasks.load_4bit import load_4bit
    from slimtune.tasks.packed_sft import packed_sft, prepare_data

    raw = json.loads(Path(args.spec).read_text())
    raw["name"] += SUFFIX
    raw.pop("guard", None)  # the reference holds 16-bit experts: no budget of the product's size holds it
    train = raw["train"]
    if train.get("micro_batch_size") == "auto":  # no budget: the whole effective batch in one micro-batch
        train.update(micro_batch_size=train.pop("effective_batch_size"), gradient_accumulation_steps=1)
    spec = parse_spec(raw)
    result: dict = {}
    t0 = time.perf_counter()
    loaded = load_4bit(spec)
    model = registry.get(loaded.handle)
    result["dense_layers"] = dense_experts(model, Path(spec.model.name_or_path), torch.bfloat16)
    lora = attach_lora(spec, loaded.handle)
    examples = prepare_data(spec, spec.model.name_or_path)
    result["load_s"] = round(time.perf_counter() - t0, 2)
    cuda = torch.cuda.is_available() and spec.model.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    report = packed_sft(
        spec,
        lora.handle,
        lora.checkpointing_handle,
        examples,
        micro_batch_size=spec.train.micro_batch_size,
        gradient_accumulation_steps=spec.train.gradient_accumulation_steps,
        gradient_checkpointing=spec.lora.gradient_checkpointing,
    )
    result.update(steps=report.steps, report=asdict(report))
    if cuda:
        result["peak_allocated_gib"] = gib(torch.cuda.max_memory_allocated())
    write_json_atomic(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
