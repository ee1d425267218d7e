"""load_4bit: the base model in NF4 with double quantization, 10% memory headroom."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from slimtune import registry
from slimtune.device import resolve_compute_dtype, resolve_device
from slimtune.families import FAMILIES
from slimtune.memory import max_memory_with_headroom
from slimtune.model_source import check_model_dir, local_model_dir
from slimtune.spec import PipelineSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What load_4bit hands on: a registry handle, never the model itself."""

    handle: str
    model_dir: str
    model_type: str
    device: str
    compute_dtype: str
    linear_4bit: int
    parameters: int

    def to_dict(self) -> dict:
        return asdict(self)


def _attn_implementation(requested: str, model_type: str) -> str:
    if requested != "auto":
        return requested
    # transformers refuses SDPA for some families (Gemma 2: SDPA has no soft-capping): eager there
    fallback = "sdpa" if FAMILIES[model_type].sdpa else "eager"
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2" if torch.cuda.is_available() else fallback
    except ImportError:
        return fallback


def load_4bit(spec: PipelineSpec) -> LoadResult:
    """Load the base model quantized to NF4 (double quant) and register it; returns its handle."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model_dir = local_model_dir(spec.model)
    cfg = check_model_dir(spec.model, model_dir)
    device = resolve_device(spec.model.device)
    dtype = resolve_compute_dtype(spec.model.compute_dtype, device)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=torch.uint8,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        quantization_config=quant,
        dtype=dtype,
        device_map={"": str(device)},
        max_memory=max_memory_with_headroom(str(device)),
        trust_remote_code=spec.model.trust_remote_code,
        use_safetensors=not spec.model.allow_pickle or None,
        attn_implementation=_attn_implementation(spec.model.attn_implementation, cfg["model_type"]),
    )
    model.config.use_cache = False
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    if n4 == 0:
        raise RuntimeError(
            f"no layer of {model_dir} was quantized to 4 bits; bitsandbytes "
            f"{bnb.__version__} may not support this device ({device})"
        )
    handle = registry.put("model", model)
    log.info("loaded %s (%s) in NF4 on %s: %d 4-bit linears", model_dir, cfg["model_type"], device, n4)
    return LoadResult(
        handle=handle,
        model_dir=str(model_dir),
        model_type=cfg["model_type"],
        device=str(device),
        compute_dtype=str(dtype).removeprefix("torch."),
        linear_4bit=n4,
        parameters=sum(p.numel() for p in model.parameters()),
    )
