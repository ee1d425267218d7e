"""Trainer's arguments for one slimtune training process: one device, DDP or FSDP-QLoRA, from the spec."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainingArguments

from slimtune.spec.schema import TrainSpec
from slimtune.train import checkpoints
from slimtune.train.options import scheduler_name


@dataclass
class _OneDeviceArguments(TrainingArguments):
    """TrainingArguments for a process that trains on exactly one device: the model's.

    Outside torchrun, transformers counts every visible GPU in `n_gpu` and uses cuda:0. On a host with
    two GPUs that doubled each micro-batch (`train_batch_size` = micro x n_gpu, all on one GPU, since
    Trainer does not DataParallel a 4-bit model) and the loss (scaled by n_gpu for DataParallel), and
    a model on cuda:1 would get its batches on cuda:0. Under DDP each rank already has one GPU.
    """

    train_device: str | None = None  # the model's device; a string so the arguments stay serialisable

    @property
    def n_gpu(self) -> int:
        return min(super().n_gpu, 1)

    @property
    def place_model_on_device(self) -> bool:
        # The loader placed every weight (and `host_embedding` the input table in host memory): Trainer
        # must not `model.to(device)` it, as its own 4-bit exemption covers only bitsandbytes-loaded models.
        return False

    @property
    def device(self) -> torch.device:
        device = super().device
        if self.world_size > 1 or self.train_device is None or device.type != "cuda":
            return device
        mine = torch.device(self.train_device)
        if torch.cuda.current_device() != mine.index:
            torch.cuda.set_device(mine)  # transformers selected cuda:0; Triton launches on the current one
        return mine


# FSDP-QLoRA (train.parallelism: fsdp), as peft's and bitsandbytes' FSDP-QLoRA guides set it up: FSDP1 with
# flat parameters (use_orig_params false), every decoder layer and every LoRA layer its own unit (Trainer
# applies peft's wrap policy, and the 4-bit storage dtype as FSDP's mixed-precision dtype, when it sees a
# PeftModel). Not FSDP2: fully_shard turns bitsandbytes' Params4bit into plain Parameters and drops their
# quantization state (axolotl-ai-cloud/axolotl#2992). Every rank loaded the same weights and seeded the same
# LoRA init, so no broadcast of rank 0's (sync_module_states), which bitsandbytes' FSDP support does not cover
# (bitsandbytes#970). The adapter is gathered whole (FULL_STATE_DICT) for rank 0 to save.
_FSDP_QLORA = {
    "version": 1,
    "reshard_after_forward": "full_shard",
    "use_orig_params": False,
    "sync_module_states": False,
    "limit_all_gathers": True,
    "state_dict_type": "FULL_STATE_DICT",
}


def training_arguments(
    train: TrainSpec,
    output_dir: Path,
    micro_batch_size: int,
    accumulation: int,
    precision: str,
    optim: str,
    device: torch.device,
    *,
    has_eval: bool,
    bucket_cap_mb: int,
    fsdp: bool = False,
) -> TrainingArguments:
    evaluate = has_eval and train.eval_steps is not None
    return _OneDeviceArguments(
        train_device=str(device) if device.type == "cuda" else None,
        output_dir=str(output_dir / checkpoints.STAGING),  # `_PublishCheckpoint` moves each one to output_dir
        per_device_train_batch_size=micro_batch_size,
        per_device_eval_batch_size=micro_batch_size,
        gradient_accumulation_steps=accumulation,
        learning_rate=train.learning_rate,
        lr_scheduler_type=scheduler_name(train.lr_scheduler),
        warmup_steps=train.warmup_steps,
        num_train_epochs=train.epochs,
        max_steps=train.max_steps if train.max_steps is not None else -1,
        optim=optim,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        seed=train.seed,
        data_seed=train.seed,
        logging_steps=train.logging_steps,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=train.eval_steps if evaluate else None,
        save_strategy="no" if fsdp else "steps",
        save_steps=train.save_steps,
        save_total_limit=train.save_total_limit,
        torch_empty_cache_steps=train.empty_cache_steps,
        # activation_checkpointing stays at its default (off): the model's own setting (configured by
        # attach_lora, possibly the offloaded variant) must not be replaced by Trainer's.
        use_cpu=device.type == "cpu",
        report_to=list(train.report_to) or "none",
        run_name=output_dir.parent.name,
        # DDP (ignored by a one-process run). Every LoRA weight is used every step, in the same order: no
        # search for unused parameters, and a static graph (DDP then also accepts the reentrant, offloaded
        # checkpointing, which re-runs each layer's forward inside backward). Trainer already skips the
        # all-reduce on the micro-batches before the last of an accumulation window (accelerator.no_sync).
        ddp_find_unused_parameters=False,
        ddp_static_graph=True,
        ddp_bucket_cap_mb=bucket_cap_mb,
        # The loss of a step is normalised by the target tokens of all ranks (gathered), and each rank's loss
        # is scaled by the world size, so the gradient mean and the logged mean across ranks are the global
        # token mean: the logged loss of N ranks equals one process's on the same rows (tests/test_ddp.py).
        average_tokens_across_devices=True,
        fsdp=fsdp,
        fsdp_config=_FSDP_QLORA if fsdp else None,
        remove_unused_columns=False,
        label_names=["labels"],
        dataloader_num_workers=0,
        include_num_input_tokens_seen="no",
        # Trainer's NaN/inf filter tests every micro-batch's loss on the host (a GPU sync per micro-batch);
        # a non-finite loss is logged as it is instead.
        logging_nan_inf_filter=False,
    )


def ddp_bucket_cap_mb(model: torch.nn.Module) -> int:
    """DDP's gradient bucket size for this model's trainable (LoRA) weights: about 8 buckets, 1-25 MB.

    DDP's default 25 MB buckets are sized for full fine-tuning (GBs of gradients). LoRA's are small (8B,
    r=16, all 7 projections: 42M fp32 values, 168 MB), so ~8 buckets let each all-reduce start while the
    backward of the earlier layers still runs; below 1 MB the per-collective launch cost dominates.
    """
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(1, min(25, round(grad_bytes / 8 / 2**20)))
