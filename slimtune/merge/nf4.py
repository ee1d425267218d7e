"""Reproduce the NF4 weights the adapter was trained against: quantize each base linear as bitsandbytes does
at load time, then dequantize it.

Verified on CPU (tests/test_merge.py): quantizing the checkpoint tensor cast to the *load* dtype with
`quantize_4bit` gives bit-identical dequantized weights to the `Params4bit` of
`from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`; quantizing from another
dtype (fp32 vs bf16) does not, hence `QuantSpec.dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from slimtune.models.experts import EXPERT_CLASSES, FUSED_STORED, HELD, per_expert_name

_STORAGE = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class QuantSpec:
    """How the trained base was quantized. `dtype` is the `dtype` given to `from_pretrained` (the tensor is
    cast to it before quantizing); None means the checkpoint's own dtype."""

    quant_type: str = "nf4"
    blocksize: int = 64
    compress_statistics: bool = True
    quant_storage: str = "uint8"
    dtype: str | None = None
    skip_modules: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict | None) -> QuantSpec:
        """Build from the `quant` argument; unknown keys are an error that lists the accepted ones."""
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"merge quant: unknown keys {sorted(unknown)}; accepted: {sorted(cls.__dataclass_fields__)}"
            )
        for key in ("dtype", "quant_storage"):
            if isinstance(d.get(key), torch.dtype):
                d[key] = str(d[key]).removeprefix("torch.")
        spec = cls(**{**d, "skip_modules": tuple(d.get("skip_modules") or ())})
        if spec.quant_type not in ("nf4", "fp4"):
            raise ValueError(f"merge quant.quant_type {spec.quant_type!r}: use 'nf4' or 'fp4'")
        if spec.dtype is not None and spec.dtype not in _FLOATS:
            raise ValueError(f"merge quant.dtype {spec.dtype!r}: use one of {sorted(_FLOATS)}")
        if spec.quant_storage not in _STORAGE:
            raise ValueError(f"merge quant.quant_storage {spec.quant_storage!r}: use one of {sorted(_STORAGE)}")
        return spec

    def bnb_config(self, compute_dtype: torch.dtype | None = None, quant_storage: torch.dtype | None = None):
        """The `BitsAndBytesConfig` of these settings: what load_4bit loads with and the merge reproduces.

        `quant_storage` overrides the dtype the packed 4-bit bytes are viewed as (FSDP-QLoRA stores them as
        the compute dtype, so FSDP can shard them with the 16-bit weights); the bytes, and so the merge,
        are the same for every storage dtype (tests/test_fsdp.py).
        """
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.compress_statistics,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_quant_storage=quant_storage or _STORAGE[self.quant_storage],
            llm_int8_skip_modules=list(self.skip_modules) or None,
        )

    def as_json(self) -> dict:
        return {**self.__dict__, "skip_modules": list(self.skip_modules)}


# The settings load_4bit trains with (blocksize 64 is bitsandbytes' fixed default for 4-bit loading).
TRAINING_NF4 = QuantSpec()


def quantized_tensor_names(base_dir: Path, spec: QuantSpec) -> set[str]:
    """Names of the weights load_4bit holds in NF4: what bitsandbytes turns into Linear4bit, found with
    transformers' own replacement on a meta-device model (no memory; about 1 s for an 8B config), so
    lm_head/tied/skipped modules match, and each expert's matrices."""
    import bitsandbytes as bnb
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import replace_with_bnb_linear
    from transformers.quantizers import AutoHfQuantizer

    qc = spec.bnb_config()
    with torch.device("meta"):
        # a multimodal checkpoint: the language model, which is what was loaded in NF4 (its own names)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir).get_text_config())
    skip = AutoHfQuantizer.from_config(qc).get_modules_to_not_convert(
        model, qc.llm_int8_skip_modules, model._keep_in_fp32_modules
    )
    model = replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=qc, pre_quantized=False)
    names = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    # and every expert matrix, which load_4bit quantizes itself (slimtune.kernels.nf4_experts), as stored
    experts = [(n, m) for n, m in model.named_modules() if type(m).__name__ in EXPERT_CLASSES]
    projections = [p for held in HELD.values() for p in held]
    for n, m in experts:
        if type(m).__name__ in FUSED_STORED:  # gpt-oss: the stored 3-D tensors, each expert's matrix on its own
            names |= {f"{n}.{projection}_proj" for projection in HELD}
        else:
            names |= {per_expert_name(n, e, p) for e in range(m.num_experts) for p in projections}
    return names


def roundtrip(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Quantize then dequantize `w` on its device; returns the dequantized weight in the load dtype. A 3-D `w` is
    a stack of expert matrices (gpt-oss's fused experts), each quantized on its own as `NF4Experts` holds them."""
    import bitsandbytes.functional as bf

    if w.dim() == 3:
        return torch.stack([roundtrip(matrix, spec) for matrix in w])

    if spec.dtype is not None:
        w = w.to(_FLOATS[spec.dtype])
    packed, state = bf.quantize_4bit(
        w.contiguous(),
        blocksize=spec.blocksize,
        compress_statistics=spec.compress_statistics,
        quant_type=spec.quant_type,
        quant_storage=_STORAGE[spec.quant_storage],
    )
    return bf.dequantize_4bit(packed, state)
