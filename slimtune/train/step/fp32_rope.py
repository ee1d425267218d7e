"""Keep the rotary embedding's `inv_freq` in float32 under FSDP's mixed precision.

FSDP1's MixedPrecision casts every registered buffer to its `buffer_dtype` at the first forward, and
transformers sets that dtype to the 4-bit storage dtype (bf16) for QLoRA. bf16 keeps 8 bits of mantissa,
so an `inv_freq` of 1.0 x 2^-9 relative error puts position 2047's highest-frequency angle off by up to
~4 rad: the FSDP run would train a different RoPE than the one-GPU run (and than the model was trained
with). The rotary modules' `inv_freq` is a non-persistent buffer (not in the state dict); making it a
plain tensor attribute of the same module keeps FSDP from seeing, and casting, it.
"""

from __future__ import annotations

import torch

_SUFFIX = "inv_freq"  # "inv_freq", or "<layer type>_inv_freq" for per-layer-type RoPE (Gemma 3)


def keep_rope_fp32(model: torch.nn.Module) -> int:
    """Turn each module's non-persistent `*inv_freq` buffers into plain attributes; returns how many.

    Only static RoPE: a dynamic rope type re-registers the buffer as it grows, which a plain attribute of
    the same name would refuse, so those modules are left as they are.
    """
    count = 0
    for module in model.modules():
        if "dynamic" in str(getattr(module, "rope_type", "")):
            continue
        for name in [n for n in module._buffers if n.endswith(_SUFFIX) and n in module._non_persistent_buffers_set]:
            value = module._buffers.pop(name)
            module._non_persistent_buffers_set.discard(name)
            # past nn.Module.__setattr__, which files a tensor flagged as a buffer back into _buffers
            object.__setattr__(module, name, value)
            count += 1
    return count
