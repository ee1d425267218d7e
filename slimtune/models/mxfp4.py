"""MXFP4, the format gpt-oss's released checkpoints store their experts in, back to 16 bits one expert matrix at a time.

A projection `<block>.<name>` ([E, in, out] in the model, `x @ W`) is stored as `<name>_blocks` [E, out, G, 16] uint8
and `<name>_scales` [E, out, G] uint8: each row of the transposed matrix in groups of 32 values, two FP4 (E2M1)
codes per byte (the low nibble first), and one power-of-two scale per group (E8M0, biased by 127). A value is
`FP4[code] * 2 ** (scale - 127)`: at most two significant bits times a power of two, so the fp32 product is exact
and so is its cast to bf16 (tests/test_family_gpt_oss.py checks it bitwise against transformers'
`convert_moe_packed_tensors`). load_4bit dequantizes one expert's matrix at a time, then quantizes the layer to NF4.
"""

from __future__ import annotations

import torch

BLOCKS, SCALES = "_blocks", "_scales"  # the suffixes of a stored MXFP4 projection's two tensors
GROUP = 32  # values per scale
_BIAS = 127  # E8M0's exponent bias
# E2M1 codes 0-15: sign bit, two exponent bits, one mantissa bit
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's matrix in the model's layout ([in, out]) from its MXFP4 `blocks` [out, G, 16] and `scales`
    [out, G].

    Raises:
        ValueError: `blocks` and `scales` do not describe the same groups.
    """
    if blocks.dim() != 3 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected [out, G, {GROUP // 2}] "
            "and [out, G]"
        )
    lut = torch.tensor(_FP4, device=blocks.device)
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).long()  # low nibble first
    exponents = scales.to(torch.int32) - _BIAS
    values = torch.ldexp(lut[codes].view(*scales.shape, GROUP), exponents.unsqueeze(-1))
    return values.view(scales.shape[0], -1).t().to(dtype)
