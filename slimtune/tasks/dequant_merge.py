"""dequant_merge: merge the LoRA adapter into 16-bit weights, tensor by tensor, within a memory budget."""

from __future__ import annotations

from pathlib import Path

import torch

from slimtune.device import resolve_compute_dtype, resolve_device
from slimtune.merge import MergeReport, merge_adapter
from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.model_source import local_model_dir
from slimtune.spec import PipelineSpec


def dequant_merge(spec: PipelineSpec, adapter_dir: str, *, maximum_memory_usage: float) -> MergeReport:
    """Write the merged model to <run>/merged (reused when inputs are unchanged and the output verifies).

    Args:
        maximum_memory_usage: the spec's value, or a lower one chosen by the memory guard on a retry.
    """
    run_dir = spec.run_dir()
    tmp = Path(spec.merge.temporary_location).expanduser() if spec.merge.temporary_location else run_dir / "spill"
    dtype = None if spec.merge.output_dtype == "auto" else getattr(torch, spec.merge.output_dtype)
    device = resolve_device(spec.model.device)
    # NF4 weights are rebuilt from the 16-bit base exactly as load_4bit quantized them, which depends on
    # the dtype the base was loaded in: quantizing from fp32 instead of bf16 gives different weights.
    trained_dtype = resolve_compute_dtype(spec.model.compute_dtype, device)
    return merge_adapter(
        local_model_dir(spec.model),
        Path(adapter_dir),
        run_dir / "merged",
        source=spec.merge.source,
        maximum_memory_usage=maximum_memory_usage,
        temporary_location=tmp,
        output_dtype=dtype,
        max_shard_bytes=int(spec.merge.max_shard_size_gb * 1e9),
        device=str(device),
        quant={**TRAINING_NF4.as_json(), "dtype": trained_dtype},
    )
