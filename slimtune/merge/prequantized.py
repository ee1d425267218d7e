"""Pre-quantized bitsandbytes 4-bit checkpoints (what `save_pretrained` writes for a `load_in_4bit` model,
e.g. `*-bnb-4bit` Hub repos): no 16-bit shards exist, so `auto` merges onto their stored NF4, dequantized.

Each 4-bit weight is stored packed (uint8, shape [n/2, 1]) beside `absmax`, `quant_map`, `nested_absmax`,
`nested_quant_map` and a JSON `quant_state.bitsandbytes__nf4` holding the real shape and dtype.
"""

from __future__ import annotations

import json

import torch

from slimtune.models.mxfp4 import BLOCKS

from .mxfp4_stored import DTYPE, dequantize_pair
from .safetensors_io import NAMES, TensorEntry, as_tensor, read_raw

_AUX = (
    "absmax",
    "quant_map",
    "nested_absmax",
    "nested_quant_map",
    "quant_state.bitsandbytes__nf4",
    "quant_state.bitsandbytes__fp4",
)
PACKED = "packed"  # key of the packed weight's own entry among its parts


def is_prequantized(config: dict) -> bool:
    """True for a config written by a model loaded with bitsandbytes `load_in_4bit`."""
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "bitsandbytes" and bool(qc.get("load_in_4bit", qc.get("_load_in_4bit")))


def split_stored_4bit(entries: list[TensorEntry]) -> tuple[list[TensorEntry], dict[str, dict[str, TensorEntry]]]:
    """Logical entries (each packed weight reported with its real shape and dtype, its parts dropped) and, per
    4-bit weight, the entries of its parts."""
    names = {e.name for e in entries}
    parts: dict[str, dict[str, TensorEntry]] = {}
    for e in entries:
        for suffix in _AUX:
            weight = e.name.removesuffix("." + suffix)
            if weight != e.name and weight in names:
                parts.setdefault(weight, {})[suffix] = e
    dropped = {p.name for d in parts.values() for p in d.values()}
    logical = []
    for e in entries:
        if e.name in dropped:
            continue
        if e.name in parts:
            state_key = next(k for k in parts[e.name] if k.startswith("quant_state."))
            state = json.loads(bytes(read_raw(parts[e.name][state_key]).numpy()))
            parts[e.name][PACKED] = e
            e = TensorEntry(
                e.name, e.file, NAMES[getattr(torch, state["dtype"])], tuple(state["shape"]), e.start, e.end
            )
        logical.append(e)
    return logical, parts


def dequantize_stored(parts: dict[str, TensorEntry], device: str) -> torch.Tensor:
    """The stored 4-bit weight dequantized on `device`, in its recorded dtype, as the trained model saw it; or an
    MXFP4 pair's fused experts (`slimtune.merge.mxfp4_stored`), in bf16."""
    import bitsandbytes.functional as bf

    if BLOCKS in parts:
        return dequantize_pair(parts, DTYPE, device)

    packed = parts[PACKED]
    tensors = {k: as_tensor(read_raw(e), e.dtype, e.shape) for k, e in parts.items() if k != PACKED}
    state = bf.QuantState.from_dict(tensors, torch.device(device))
    data = as_tensor(read_raw(packed), packed.dtype, packed.shape).to(device)
    return bf.dequantize_4bit(data, state)
