"""The run plan: what the flow resolves from the spec once, before any model is loaded, and hands to every task.

The model folder (built, local or downloaded), its config.json, the family, the device and the compute dtype
are facts of the run, not of a stage: resolved in one place they cannot drift between load_4bit (which
quantizes in the compute dtype) and dequant_merge (which must re-quantize the base exactly the same way).
The plan holds only strings and the config dict, so Prefect can take it as a task parameter (and JSON it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimtune.core.device import resolve_compute_dtype, resolve_device
from slimtune.models.multimodal import trained_config
from slimtune.models.source import check_model_dir, local_model_dir
from slimtune.spec.schema import PipelineSpec


@dataclass(frozen=True)
class RunPlan:
    """The resolved facts of one run; build it with `resolve_plan`.

    Attributes:
        model_dir: the local folder holding the base model's files.
        config: the base model's config.json (already checked by `check_model_dir`); treat it as read-only.
        family: config.json's model_type, a key of `slimtune.models.families.FAMILIES`.
        device: the torch device the run trains on ("cpu", "cuda:0").
        compute_dtype: the dtype NF4 layers compute in and the base is loaded in ("float32", "bfloat16", ...).
    """

    model_dir: str
    config: dict
    family: str
    device: str
    compute_dtype: str

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)


def resolve_plan(spec: PipelineSpec) -> RunPlan:
    """Find (or build, or download) the model, check its files, and choose device and dtype: once per run.

    Raises:
        ModelSourceError: the model cannot be used as given (the message names the field and the fix).
        RuntimeError: model.device or model.compute_dtype is not available on this machine.
    """
    model_dir = local_model_dir(spec.model)
    config = trained_config(check_model_dir(spec.model, model_dir))  # a multimodal one's language model
    device = resolve_device(spec.model.device)
    dtype = resolve_compute_dtype(spec.model.compute_dtype, device)
    return RunPlan(
        model_dir=str(model_dir),
        config=config,
        family=config["model_type"],
        device=str(device),
        compute_dtype=str(dtype).removeprefix("torch."),
    )


def plan_for(spec: PipelineSpec, plan: RunPlan | None) -> RunPlan:
    """`plan`, or one resolved now for a caller outside the flow (tests, benchmarks, the DDP workers)."""
    return plan if plan is not None else resolve_plan(spec)
