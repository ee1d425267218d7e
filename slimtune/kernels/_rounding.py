"""Round-to-nearest-even into bfloat16 by integer arithmetic, identical on the GPU and in the interpreter.

The GPU's fp32 -> bf16 conversion rounds to nearest even; Triton 3.9's CPU interpreter truncates. Where
a kernel must reproduce eager PyTorch bit for bit (NF4 dequantization, Llama's RMSNorm cast), it rounds
with integers instead, so the CPU tests check the exact result the GPU produces.
"""

import triton
import triton.language as tl


@triton.jit
def bf16_rtne_bits(x):
    """fp32 tensor -> its bf16 rounding as int16 bit patterns (finite inputs; NaN payloads not preserved)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.int16)


@triton.jit
def bf16_rtne(x):
    """fp32 tensor rounded to the nearest bf16 value, returned as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
