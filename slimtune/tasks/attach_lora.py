"""attach_lora: LoRA adapters via peft on the registered 4-bit model, with the chosen checkpointing."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from slimtune import registry
from slimtune.families import lora_target_modules
from slimtune.kernels import apply_kernels
from slimtune.memory.checkpointing import checkpoint_pass, enable_checkpointing
from slimtune.spec import PipelineSpec, TrainSpec

log = logging.getLogger(__name__)
_EMBEDDINGS = ("embed_tokens", "lm_head")


# DDP and FSDP want every parameter on the rank's GPU (they check device types and broadcast or shard them
# at wrap time); the guard's estimate for a multi-GPU run leaves these kernels out too.
MULTI_GPU_EXCLUDED_KERNELS = {"host_embedding": "train.num_gpus > 1: DDP/FSDP keep every parameter on the rank's GPU"}
# FSDP1 (flat parameters) replaces each weight by a plain view of its unit's flat parameter, valid only while
# that unit computes: lora_nf4 reads `base_layer.weight.quant_state` (gone from the view; bitsandbytes' own
# forward restores it from the module) and the LoRA weights, which are FSDP units of their own, from the
# outer layer's forward (sharded there).
FSDP_EXCLUDED_KERNELS = {
    **MULTI_GPU_EXCLUDED_KERNELS,
    "lora_nf4": "train.parallelism fsdp: FSDP1 flattens the NF4 weight (its quant_state is gone) and shards "
    "the LoRA weights the kernel reads",
}


def excluded_kernels(train: TrainSpec) -> dict[str, str]:
    """Kernels this run leaves out, with why (attach_lora applies, the estimate assumes the same)."""
    if train.sharded:
        return FSDP_EXCLUDED_KERNELS
    return MULTI_GPU_EXCLUDED_KERNELS if train.num_gpus > 1 else {}


def rank_checkpointing(train: TrainSpec, mode: bool | str) -> bool | str:
    """The checkpointing a rank runs: under FSDP "unsloth" becomes standard (non-reentrant) checkpointing.

    "unsloth" runs each layer under no_grad and hands `layer.parameters()` to an autograd Function that
    re-runs the layer in its backward; under FSDP1 those are the nested LoRA units' sharded flat parameters,
    gathered and reduced by FSDP's hooks around a recompute they were not written for: not verified, so
    offloaded checkpointing is not offered under FSDP yet. Standard checkpointing recomputes through the
    module calls inside the layer's FSDP unit, as Answer.AI's fsdp_qlora does.
    """
    if train.sharded and mode == "unsloth":
        return True
    return mode


@dataclass(frozen=True)
class LoraResult:
    """The handle (now pointing at the peft model) and what was made trainable."""

    handle: str
    checkpointing_handle: str
    trainable_parameters: int
    total_parameters: int
    target_modules: list[str]
    gradient_checkpointing: str
    offloading: bool
    kernels: dict[str, int]  # kernel name -> modules patched (train.kernels)
    kernels_skipped: dict[str, str]  # kernel name -> why not

    def to_dict(self) -> dict:
        return asdict(self)


def _embedding_dtype(device: torch.device) -> torch.dtype:
    # fp16 master weights are unstable for full embedding training (T4-class GPUs without bf16): fp32 there.
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _offload_frozen_embeddings(model: torch.nn.Module, device: torch.device) -> None:
    """Trainable copies stay on the device; the frozen originals only cost host memory."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _EMBEDDINGS and hasattr(module, "original_module"):
            module.original_module.to("cpu")
            module.modules_to_save.to(device=device, dtype=_embedding_dtype(device))


def attach_lora(spec: PipelineSpec, handle: str) -> LoraResult:
    """Wrap the model behind `handle` with LoRA (peft) and configure gradient checkpointing."""
    from peft import LoraConfig, get_peft_model

    model = registry.get(handle)
    if spec.lora.train_embeddings and model.config.tie_word_embeddings:
        raise ValueError(
            "lora.train_embeddings: this model ties embed_tokens and lm_head, so training "
            "separate copies would untie them; set lora.train_embeddings: false"
        )
    device = next(model.parameters()).device
    for p in model.parameters():
        p.requires_grad_(False)
    config = LoraConfig(
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        # the spec's q/k/v/gate/up names become a fused family's own (Phi-3: qkv_proj, gate_up_proj)
        target_modules=lora_target_modules(model.config.model_type, spec.lora.target_modules),
        use_rslora=spec.lora.use_rslora,
        bias=spec.lora.bias,
        task_type="CAUSAL_LM",
        modules_to_save=list(_EMBEDDINGS) if spec.lora.train_embeddings else None,
    )
    torch.manual_seed(spec.train.seed)  # LoRA A is randomly initialised: same spec, same adapter
    peft_model = get_peft_model(model, config)
    try:
        return _configure(spec, handle, peft_model, device)
    except BaseException:
        # peft injected the LoRA layers into the registered model in place: a retry (out of memory) must get the
        # base model back, or its get_peft_model stacks a second adapter ("multiple adapters" warning)
        peft_model.unload()
        raise


def _configure(spec: PipelineSpec, handle: str, peft_model, device: torch.device) -> LoraResult:
    """Place the LoRA weights, set up checkpointing and kernels, and register the peft model under `handle`."""
    if spec.train.sharded:
        # peft puts each LoRA weight beside its base weight, which an FSDP rank's load left on the host
        # (load_4bit.loads_on_host): onto the rank's device with the rest, where the trainer looks for it.
        with torch.no_grad():
            for p in peft_model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(device)
    if spec.lora.train_embeddings:
        _offload_frozen_embeddings(peft_model, device)
    mode = rank_checkpointing(spec.train, spec.lora.gradient_checkpointing)
    if mode != spec.lora.gradient_checkpointing:
        log.warning("lora.gradient_checkpointing %s runs as %s under FSDP", spec.lora.gradient_checkpointing, mode)
    checkpointing = enable_checkpointing(peft_model, mode)
    peft_model.config.use_cache = False
    kernels = apply_kernels(
        peft_model,
        spec.train.kernels,  # logs what it applied and skipped, and why
        exclude=excluded_kernels(spec.train) or None,
        # "unsloth" checkpointing's passes: lora_nf4 keeps its casts in the first for the recompute, which skips
        # the output nobody reads
        checkpoint_pass=checkpoint_pass,
    )
    registry.replace(handle, peft_model)
    # The checkpointing handle holds pinned host buffers, the kernel patch the patched modules (and a
    # host-resident embedding table): both live in the registry so cleanup drops them with the model.
    ckpt_handle = registry.put("checkpointing", checkpointing)
    registry.put("kernels", kernels)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    targets = sorted(peft_model.peft_config["default"].target_modules)
    hidden = getattr(peft_model.config, "hidden_size", None)
    if hidden is not None and spec.lora.r > hidden:
        log.warning(
            "lora.r %d exceeds the model's hidden size %d: the update's rank cannot exceed %d, so the extra rank "
            "only costs memory and changes the alpha / r scaling; lower lora.r to %d or less",
            spec.lora.r,
            hidden,
            hidden,
            hidden,
        )
    log.info(
        "LoRA r=%d on %s: %d trainable of %d parameters, checkpointing=%s",
        spec.lora.r,
        targets,
        trainable,
        total,
        spec.lora.gradient_checkpointing,
    )
    return LoraResult(
        handle=handle,
        checkpointing_handle=ckpt_handle,
        trainable_parameters=trainable,
        total_parameters=total,
        target_modules=targets,
        gradient_checkpointing=str(mode),
        offloading=checkpointing.offloading,
        kernels=dict(kernels.modules),
        kernels_skipped=dict(kernels.skipped),
    )
