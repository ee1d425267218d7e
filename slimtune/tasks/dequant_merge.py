"""dequant_merge: merge the LoRA adapter into 16-bit weights, tensor by tensor, within a memory budget."""

from __future__ import annotations

from pathlib import Path

import torch

from slimtune.merge import MergeReport, merge_adapter
from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.plan.run_plan import RunPlan, plan_for
from slimtune.spec.schema import PipelineSpec


def dequant_merge(
    spec: PipelineSpec, adapter_dir: str, *, maximum_memory_usage: float, plan: RunPlan | None = None
) -> MergeReport:
    """Write the merged model to <run>/merged (reused when inputs are unchanged and the output verifies).

    Args:
        maximum_memory_usage: the spec's value, or a lower one chosen by the memory guard on a retry.
        plan: the flow's run plan (base model folder, device, compute dtype); resolved here when called on its own.
    """
    plan = plan_for(spec, plan)
    run_dir = spec.run_dir()
    tmp = Path(spec.merge.temporary_location).expanduser() if spec.merge.temporary_location else run_dir / "spill"
    dtype = None if spec.merge.output_dtype == "auto" else getattr(torch, spec.merge.output_dtype)
    # NF4 weights are rebuilt from the 16-bit base exactly as load_4bit quantized them, which depends on
    # the dtype the base was loaded in (plan.dtype): quantizing from fp32 instead of bf16 gives different weights.
    return merge_adapter(
        Path(plan.model_dir),
        Path(adapter_dir),
        run_dir / "merged",
        source=spec.merge.source,
        maximum_memory_usage=maximum_memory_usage,
        temporary_location=tmp,
        output_dtype=dtype,
        max_shard_bytes=int(spec.merge.max_shard_size_gb * 1e9),
        device=plan.device,
        quant={**TRAINING_NF4.as_json(), "dtype": plan.dtype},
    )
