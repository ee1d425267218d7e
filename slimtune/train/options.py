"""Resolving the spec's training choices against the model and device: precision, optimizer, batching."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from slimtune.data import BatchMode
from slimtune.models.families import SUPPORTED_MODEL_TYPES
from slimtune.train.step.attention import VARLEN
from slimtune.train.step.linear_attention import isolate_documents
from slimtune.train.step.packed_masks import mask_documents

log = logging.getLogger(__name__)

# Model types whose attention keeps packed examples apart given restarting position ids and no mask:
# each is checked by tests/test_packing.py (packed loss == token-weighted mean of the examples' own
# losses to 1e-5) for every family of slimtune.models.families. Others fall back to padded batches rather
# than silently attend across examples.
ISOLATING_MODEL_TYPES = frozenset(SUPPORTED_MODEL_TYPES)
# Attention implementations that build the block-diagonal mask from position ids (transformers >= 5).
_POSITION_MASKED = ("sdpa", "eager", "flex_attention")
# Attention implementations that take the micro-batch flattened to one row with `cu_seq_lens` boundaries.
_VARLEN = ("flash_attention_2", VARLEN)
_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


@dataclass(frozen=True)
class Batching:
    """How rows reach the model: the mode used, flash varlen or not, and why it differs from the spec."""

    mode: BatchMode
    flash_varlen: bool
    fallback_reason: str | None = None


def choose_batching(model: torch.nn.Module, requested: BatchMode) -> Batching:
    """Packed or padding-free where the model's attention isolates examples, padded otherwise.

    Packed rows get a model's linear-attention layers restarted at each document (`isolate_documents`, for the
    model's lifetime: padded inputs go through those layers unchanged), and masks built from the position ids
    where the model builds them without (`mask_documents`)."""
    if requested == "padded":
        return Batching("padded", False)
    config = model.config
    model_type = getattr(config, "model_type", None)
    attn = getattr(config, "_attn_implementation", None)
    reason = None
    if model_type not in ISOLATING_MODEL_TYPES:
        reason = (
            f"model_type {model_type!r} is not verified to isolate packed examples (verified: "
            f"{', '.join(sorted(ISOLATING_MODEL_TYPES))})"
        )
    elif attn not in _VARLEN and attn not in _POSITION_MASKED:
        reason = f"attention {attn!r} does not build masks from position ids; use sdpa or flash_attention_2"
    if reason:
        log.warning("data.packing %s falls back to padded batches: %s", requested, reason)
        return Batching("padded", False, reason)
    isolate_documents(model)
    mask_documents(model)  # gpt-oss builds its masks without the position ids
    return Batching(requested, attn in _VARLEN)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the model trains on: its trainable (LoRA) parameters'.

    Not simply the first parameter's: that is the input-embedding table, which the `host_embedding`
    kernel keeps in host memory; taken for the device, it sent the whole run to the CPU.
    """
    params = list(model.parameters())
    return next((p.device for p in params if p.requires_grad), params[0].device)


def resolve_precision(precision: str, device: torch.device) -> str:
    """bf16, fp16 or fp32: auto = bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU."""
    cuda = device.type == "cuda"
    if precision == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and not cuda:
        raise ValueError("train.precision fp16 needs a CUDA GPU; use bf16 or fp32 on the CPU")
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise ValueError("train.precision bf16 is not supported on this GPU; use fp16 or fp32")
    return precision


def resolve_optimizer(optimizer: str, device: torch.device) -> str:
    """The TrainingArguments `optim` name: fused AdamW on GPU, paged 8-bit AdamW only on GPU."""
    cuda = device.type == "cuda"
    if optimizer == "paged_adamw_8bit" and not cuda:
        raise ValueError(
            "train.optimizer paged_adamw_8bit pages optimizer state through CUDA memory; use adamw_torch on the CPU"
        )
    if optimizer == "adamw_torch" and cuda:
        # Same update rule, one fused kernel for all parameters instead of one launch per tensor.
        return "adamw_torch_fused"
    if optimizer == "adamw_torch_fused" and not cuda:
        return "adamw_torch"
    return optimizer


def scheduler_name(lr_scheduler: str) -> str:
    """TrainingArguments' name for the spec's decay after warmup."""
    return _SCHEDULERS[lr_scheduler]
