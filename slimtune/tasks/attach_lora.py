"""attach_lora: LoRA adapters via peft on the registered 4-bit model, with the chosen checkpointing."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch

from slimtune.core import registry
from slimtune.kernels import apply_kernels, compute_device
from slimtune.models.lora_targets import expert_lora_targets, lora_target_modules
from slimtune.plan.run_plan import RunPlan, plan_for
from slimtune.plan.train_settings import TrainSettings, card_bytes, resolve_train
from slimtune.spec.schema import PipelineSpec
from slimtune.tasks.load_tables import unread_tables_to_device
from slimtune.train.step import enable_checkpointing

log = logging.getLogger(__name__)
_EMBEDDINGS = ("embed_tokens", "lm_head")


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


def attach_lora(spec: PipelineSpec, handle: str, plan: RunPlan | None = None) -> LoraResult:
    """Wrap the model behind `handle` with LoRA (peft) and configure gradient checkpointing.

    Args:
        plan: the run plan (its config and device give the run's `TrainSettings`); resolved when not given.
    """
    from peft import LoraConfig, get_peft_model

    plan = plan_for(spec, plan)
    # its checkpointing and kernels (the card decides where the lm_head lives)
    settings = resolve_train(spec, plan.config, plan.torch_device.type, card=card_bytes(spec, plan.torch_device))
    model = registry.get(handle)
    if spec.lora.train_embeddings and model.config.tie_word_embeddings:
        raise ValueError(
            "lora.train_embeddings: this model ties embed_tokens and lm_head, so training "
            "separate copies would untie them; set lora.train_embeddings: false"
        )
    device = compute_device(model)  # not the first parameter's: load_4bit may have read the tables into host memory
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
    experts = _attach_expert_lora(spec, peft_model)
    try:
        return _configure(spec, handle, peft_model, device, settings, experts)
    except BaseException:
        # peft injected the LoRA layers into the registered model in place: a retry (out of memory) must get the
        # base model back, or its get_peft_model stacks a second adapter ("multiple adapters" warning)
        for block in experts:
            block.remove_lora()
        peft_model.unload()
        raise


def _attach_expert_lora(spec: PipelineSpec, peft_model) -> list:
    """LoRA on a mixture-of-experts model's experts, which peft does not reach (3-D tensors, `NF4Experts`)."""
    from slimtune.kernels.nf4_experts import NF4Experts

    projections = expert_lora_targets(peft_model.config.model_type, spec.lora.target_modules)
    blocks = [m for m in peft_model.modules() if isinstance(m, NF4Experts)] if projections else []
    lora = spec.lora
    scale = lora.alpha / math.sqrt(lora.r) if lora.use_rslora else lora.alpha / lora.r  # as peft scales
    for block in blocks:
        block.add_lora(lora.r, scale, projections, dropout=lora.dropout)
    if blocks:
        log.info("LoRA r=%d on the %s projections of %d expert blocks", lora.r, ", ".join(projections), len(blocks))
    return blocks


def _configure(
    spec: PipelineSpec, handle: str, peft_model, device: torch.device, settings: TrainSettings, experts: list
) -> LoraResult:
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
    mode = settings.checkpointing
    if mode != spec.lora.gradient_checkpointing:
        log.warning("lora.gradient_checkpointing %s runs as %s under FSDP", spec.lora.gradient_checkpointing, mode)
    checkpointing = enable_checkpointing(peft_model, mode)
    peft_model.config.use_cache = False
    kernels = apply_kernels(
        peft_model,
        spec.train.kernels,  # logs what it applied and skipped, and why
        exclude=settings.kernels_excluded or None,
        # "unsloth" checkpointing's passes: lora_nf4 keeps its casts in the first for the recompute, which skips
        # the output nobody reads
        checkpoint_pass=checkpointing.layer_pass,
    )
    unread_tables_to_device(peft_model.get_base_model(), kernels, device)
    registry.replace(handle, peft_model)
    # The checkpointing handle holds pinned host buffers, the kernel patch the patched modules (and a
    # host-resident embedding table): both live in the registry so cleanup drops them with the model.
    ckpt_handle = registry.put("checkpointing", checkpointing)
    registry.put("kernels", kernels)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    expert_targets = [f"experts.{p}_proj" for p in (experts[0].lora_projections() if experts else [])]
    targets = sorted([*peft_model.peft_config["default"].target_modules, *expert_targets])
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
