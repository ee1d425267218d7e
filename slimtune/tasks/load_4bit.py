"""load_4bit: the base model in NF4 with double quantization, 10% memory headroom."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from slimtune.core import registry
from slimtune.memory import max_memory_with_headroom
from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.models.families import FAMILIES
from slimtune.models.multimodal import copied_keys, copied_part, text_model_load_kwargs
from slimtune.plan.run_plan import RunPlan, plan_for
from slimtune.spec.schema import PipelineSpec

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
    if FAMILIES[model_type].attention_sinks:  # flash-attn 2 drops gpt-oss's sinks without a word
        return "eager"
    # transformers refuses SDPA for some families (Gemma 2: SDPA has no soft-capping): eager there
    fallback = "sdpa" if FAMILIES[model_type].sdpa else "eager"
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2" if torch.cuda.is_available() else fallback
    except ImportError:
        return fallback


def keep_training_layout(model: torch.nn.Module) -> int:
    """Keep bitsandbytes from repacking 4-bit weights for CPU inference; returns the number of 4-bit linears.

    On a CPU with AVX512-BF16, bitsandbytes 0.50.2's `Linear4bit.forward` rewrites the weight in place into
    its packed inference layout the first time it runs in eval mode without grad (the eval pass before
    training), and `matmul_4bit` then takes the inference-only kernel for good, in training too: no
    autograd through the base weight (earlier layers' LoRA gradients come out wrong), and for biased
    layers (Qwen2's q/k/v) an in-place `result += bias` that autograd refuses. Converting back after eval
    is lossy (the packing rounds the double-quantized absmax to bf16), so packing is turned off per
    instance instead; the eval pass then uses the same dequantize kernel as training.
    """
    import bitsandbytes as bnb

    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in linears:
        m.support_avx512bf16_for_cpu = False
    return len(linears)


def _keep_quant_state_on_module(model: torch.nn.Module) -> None:
    """Give each 4-bit linear its weight's quantization state, where bitsandbytes looks for it under FSDP.

    FSDP1 replaces the weight by a plain view of its flat parameter, losing `weight.quant_state`;
    bitsandbytes' forward restores it from `module.quant_state`, which it sets only when the `Params4bit`
    was created with its module (transformers does; a loader that does not would fail at the first step).
    """
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and getattr(m, "quant_state", None) is None:
            m.quant_state = m.weight.quant_state


def loads_on_host(spec: PipelineSpec, device: torch.device) -> bool:
    """FSDP on GPUs: each rank quantizes the model in host memory and FSDP moves it to the GPU unit by unit.

    Loaded onto the GPU, every rank would hold the whole NF4 model before FSDP shards it: more than one GPU
    running the same step alone (14B: 11.2 vs 10.0 GiB), so sharding could never fit a model one GPU cannot.
    """
    return spec.train.sharded and device.type == "cuda"


def tables_on_host(spec: PipelineSpec, plan: RunPlan) -> bool:
    """Whether load_4bit reads the input table and lm_head into pinned host memory (`reads_tables_to_host` for this
    run's card and checkpoint)."""
    from slimtune.plan.train_settings import card_bytes, head_on_host, reads_tables_to_host

    host = head_on_host(spec, plan.config, plan.torch_device.type, card_bytes(spec, plan.torch_device))
    return reads_tables_to_host(host, plan.family, bool(text_model_load_kwargs(Path(plan.model_dir))))


def _place_for_fsdp(model: torch.nn.Module, device: torch.device) -> None:
    """Everything but the 4-bit weights onto the rank's GPU; FSDP1 (`device_id`) moves those as it wraps.

    What stays on the host is only the decoder layers' packed NF4 data: FSDP moves each layer's unit to the
    GPU and shards it before the next (`Params4bit.to`), so a rank never holds more than one whole layer of
    it. The rest (tables, norms, biases, buffers, each quantization state) is small or gathered for every
    step anyway, and on the GPU the kernels and the trainer see the rank's device. `hf_device_map` names that
    device, as a GPU load would: accelerate refuses to train a 4-bit model it believes is on the CPU.
    """
    import bitsandbytes as bnb

    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if not isinstance(p, bnb.nn.Params4bit):
                    p.data = p.data.to(device)  # the same Parameter: tied weights stay tied
            for name, b in module.named_buffers(recurse=False):
                module._buffers[name] = b.to(device)
            if isinstance(module, bnb.nn.Linear4bit):
                module.weight.quant_state.to(device)  # in place; the module's own reference is the same object
    model.hf_device_map = {"": str(device)}


class _HeldLoadReport(logging.Filter):
    """Holds back transformers' load report (a table row per checkpoint key the model did not load)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName == "log_state_dict_report":
            self.records.append(record)
            return False
        return True


def _without_mxfp4(model_dir: Path) -> dict[str, Any]:
    """`config=` without the MXFP4 quantization_config of gpt-oss's released checkpoints (transformers refuses a
    BitsAndBytesConfig beside it): only their experts are MXFP4, and load_nf4_experts reads those."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if (getattr(config, "quantization_config", None) or {}).get("quant_method") != "mxfp4":
        return {}
    del config.quantization_config
    return {"config": config}


@contextmanager
def _load_report_held(hold: bool) -> Iterator[None]:
    """Around one `from_pretrained` of a multimodal checkpoint's language model or of an MoE built without its
    experts: its load report would list every vision tensor (Gemma-3-4B: 439 rows) or fused expert tensor as
    unexpected, so it is held back and `_report_unloaded` says what matters. Scoped to the call; if loading fails,
    the report is emitted as transformers wrote it (its error points to it)."""
    if not hold:
        yield
        return
    logger, held = logging.getLogger("transformers.modeling_utils"), _HeldLoadReport()
    logger.addFilter(held)
    try:
        yield
    except BaseException:
        logger.removeFilter(held)
        for record in held.records:
            logger.handle(record)
        raise
    finally:
        logger.removeFilter(held)


def _report_unloaded(model_dir: Path, loading_info: dict[str, Any], experts: set[str]) -> None:
    """One line for the vision tower and mtp weights left for the merge to copy (by the merge's own rule), a warning
    for any other key the load did not use or did not find, but `experts` (what `load_nf4_experts` loads after): those
    are a real problem and must stay visible."""
    from slimtune.merge.safetensors_io import checkpoint_shards, read_entries

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    keys = [e.name for shard in checkpoint_shards(model_dir) for e in read_entries(shard)]
    parts = Counter(part for key in copied_keys(config, keys) if (part := copied_part(key)) is not None)
    if parts:
        log.info(
            "%s: left %s tensors unloaded, for the merge to copy as stored",
            model_dir,
            " and ".join(f"{n} {part}" for part, n in sorted(parts.items())),
        )
    unexpected = sorted(k for k in loading_info["unexpected_keys"] if copied_part(k) is None and k not in experts)
    missing = sorted(loading_info["missing_keys"])
    if unexpected or missing:
        log.warning(
            "%s: the language model did not load %d checkpoint keys outside its vision tower and mtp: %s; "
            "and %d of its weights are missing from the checkpoint (newly initialized): %s",
            model_dir,
            len(unexpected),
            ", ".join(unexpected) or "none",
            len(missing),
            ", ".join(missing) or "none",
        )


def load_4bit(spec: PipelineSpec, plan: RunPlan | None = None) -> LoadResult:
    """Load the base model quantized to NF4 (double quant) and register it; returns its handle.

    Args:
        plan: the flow's run plan (model folder, device, dtype); resolved here when called on its own.
    """
    import bitsandbytes as bnb
    import transformers
    from transformers import AutoModelForCausalLM

    from slimtune.tasks.load_experts import fused_names, load_nf4_experts, without_dense_experts
    from slimtune.tasks.load_tables import load_host_tables, table_names, without_tables

    plan = plan_for(spec, plan)
    model_dir, device, dtype = Path(plan.model_dir), plan.torch_device, plan.dtype
    fsdp = spec.train.sharded
    quant = TRAINING_NF4.bnb_config(dtype, quant_storage=dtype if fsdp else None)
    on_host = loads_on_host(spec, device)
    load_device = torch.device("cpu") if on_host else device
    multimodal = text_model_load_kwargs(model_dir)  # a multimodal checkpoint: its language model, no vision tower
    mxfp4 = _without_mxfp4(model_dir) if FAMILIES[plan.family].fused_experts else {}
    family = FAMILIES[plan.family]
    host_tables = tables_on_host(spec, plan)
    # an MoE: built without its 16-bit experts, which load_nf4_experts quantizes one layer at a time after the load
    loader = AutoModelForCausalLM
    if family.experts:
        loader = without_dense_experts(getattr(transformers, family.architecture))
    elif host_tables:
        loader = without_tables(getattr(transformers, family.architecture))
    with _load_report_held(bool(multimodal) or family.experts or host_tables):
        model, loading_info = loader.from_pretrained(
            model_dir,
            quantization_config=quant,
            dtype=dtype,
            device_map={"": str(load_device)},
            max_memory=max_memory_with_headroom(str(load_device)),
            trust_remote_code=spec.model.trust_remote_code,
            use_safetensors=not spec.model.allow_pickle or None,
            attn_implementation=_attn_implementation(spec.model.attn_implementation, plan.family),
            output_loading_info=True,
            **multimodal,
            **mxfp4,
        )
    if multimodal or family.experts or host_tables:
        _report_unloaded(model_dir, loading_info, fused_names(model) | (table_names(model) if host_tables else set()))
    if host_tables:
        load_host_tables(model, model_dir, dtype, pin=device.type == "cuda")
        log.info("%s: input table and lm_head read into pinned host memory (the card is too small for them)", model_dir)
    model.config.use_cache = False
    n4 = keep_training_layout(model)
    n_experts = load_nf4_experts(model, model_dir, dtype, load_device)
    if fsdp:
        _keep_quant_state_on_module(model)
    if on_host:
        _place_for_fsdp(model, device)
    if n4 == 0:
        raise RuntimeError(
            f"no layer of {model_dir} was quantized to 4 bits; bitsandbytes "
            f"{bnb.__version__} may not support this device ({device})"
        )
    handle = registry.put("model", model)
    log.info(
        "loaded %s (%s) in NF4 on %s: %d 4-bit linears%s",
        model_dir,
        plan.family,
        device,
        n4,
        f", {n_experts} expert blocks" if n_experts else "",
    )
    return LoadResult(
        handle=handle,
        model_dir=str(model_dir),
        model_type=plan.family,
        device=str(device),
        compute_dtype=plan.compute_dtype,
        linear_4bit=n4,
        parameters=sum(p.numel() for p in model.parameters()),
    )
