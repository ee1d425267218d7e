"""packed_sft: supervised fine-tuning on packed, padding-free batches, with checkpoints and resume."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from slimtune.core import registry
from slimtune.export.model_card import write_adapter_card
from slimtune.plan.run_plan import RunPlan, plan_for
from slimtune.spec.schema import PipelineSpec
from slimtune.train.result import TrainReport
from slimtune.train.step import enable_checkpointing

if TYPE_CHECKING:
    from transformers import TrainerCallback

log = logging.getLogger(__name__)


def prepare_data(spec: PipelineSpec, model_dir: str) -> str:
    """Read, check and tokenize the data before any model is loaded; returns a registry handle.

    Bad data (file:line:field) fails here, in seconds, rather than after the model is on the GPU.
    """
    from transformers import AutoTokenizer

    from slimtune.data import load_examples

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=spec.model.trust_remote_code)
    examples = load_examples(spec.data, tokenizer)
    return registry.put("examples", (tokenizer, examples))


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of the trainable (LoRA) weights: megabytes, not the model."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def packed_sft(
    spec: PipelineSpec,
    model_handle: str,
    checkpointing_handle: str,
    examples_handle: str,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    gradient_checkpointing: bool | str,
    plan: RunPlan | None = None,
    callbacks: list[TrainerCallback] | None = None,
    cuda_graphs: bool | None = None,
    stored_layers: int = 0,
) -> TrainReport:
    """Train the LoRA adapter; micro-batch, accumulation and checkpointing may be downshifted by the guard.

    Args:
        plan: the flow's run plan (the adapter card names the base model's license); resolved when not given.
        callbacks: extra Trainer callbacks (benchmarks/profile_step.py profiles the product's steps with one).
        cuda_graphs: whether to capture the layers' backward (default `train.cuda_graphs`; the flow turns them off
            where their memory does not fit the budget).
        stored_layers: how many of the last checkpointed layers keep their activations (`TrainSettings`).
    """
    model = registry.get(model_handle)
    current = registry.get(checkpointing_handle)
    if current.mode != gradient_checkpointing:
        log.info("switching gradient checkpointing %s -> %s", current.mode, gradient_checkpointing)
        current.undo()
        # the same LayerPass: the kernels attach_lora patched in read it
        registry.replace(checkpointing_handle, enable_checkpointing(model, gradient_checkpointing, current.layer_pass))
    # A retry after out-of-memory must not continue from the weights the failed attempt already updated:
    # every attempt starts from the adapter as attach_lora made it (a resume then loads its checkpoint).
    initial = registry.setdefault(f"initial-adapter:{model_handle}", lambda: _trainable_state(model))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in initial:
                param.copy_(initial[name])
    tokenizer, examples = registry.get(examples_handle)
    plan = plan_for(spec, plan)
    # transformers' Trainer (and with it peft, bitsandbytes): imported by the stage that trains, not by the flow module
    from slimtune.train.trackers import tracker_params
    from slimtune.train.trainer import train_adapter

    report = train_adapter(
        model,
        tokenizer,
        examples,
        spec.train,
        spec.data,
        spec.run_dir(),
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        callbacks=callbacks,
        cuda_graphs=spec.train.cuda_graphs if cuda_graphs is None else cuda_graphs,
        stored_layers=stored_layers,
        tracker_params=tracker_params(spec, plan.compute_dtype),
        describe=lambda report: describe_adapter(spec, report, plan),
    )
    return report


def describe_adapter(spec: PipelineSpec, report: TrainReport, plan: RunPlan) -> list[Path]:
    """The adapter's own model card, and its base named by Hub id rather than the local cache path peft saw;
    returns the card's path."""
    from slimtune.tasks.gguf_convert_and_push import LORA_FACTS, card_hyperparameters, card_license

    write_adapter_card(
        Path(report.adapter_dir),
        base_model=spec.model.name_or_path,
        datasets=spec.data.files(),
        lora={k: getattr(spec.lora, k) for k in LORA_FACTS},
        metrics={
            "steps": report.steps,
            "eval_loss_before": report.eval_loss_before,
            "eval_loss_after": report.eval_loss_after,
            "tokens_seen": report.tokens_seen,
        },
        license_id=card_license(spec, plan.model_dir),
        name=spec.name,
        hyperparameters=card_hyperparameters(spec, asdict(report), plan.compute_dtype),
    )
    return [Path(report.adapter_dir) / "README.md"]
