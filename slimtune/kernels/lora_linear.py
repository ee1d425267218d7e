"""LoRA linear over a frozen NF4 base: dequantize, matmul, add `scale * (x A^T) B^T`, hand-written backward.

Why not peft's path: for a bf16 model peft keeps the adapters in fp32, so each LoRA layer casts its
input to fp32 and saves that copy for backward (for `down_proj` at 4x2048 tokens: 8192 x 14336 x 4 B
= 448 MiB per layer recompute) and runs three separate autograd nodes. Here the adapters are cast to
the activation dtype (r=16: 2 x 16 x 14336 values, negligible), the base weight is dequantized by the
Triton NF4 kernel into one reused scratch buffer, the LoRA product is accumulated into the base
output with one `addmm_`, and backward produces only what training needs: d(input), d(A), d(B);
the frozen base and its bias get no gradient.
"""

from __future__ import annotations

import torch

from .nf4 import dequantize_nf4_scratch


class _LoRANF4Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, quant_state, bias, lora_a, lora_b, scale: float):
        x2 = x.reshape(-1, x.shape[-1])
        dtype = x.dtype
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        # y is allocated in its final shape and written through a 2-D view: RoPE rotates q/k projections
        # in place, which autograd forbids on a view created inside a custom Function
        y = torch.empty(*x.shape[:-1], b.shape[0], dtype=dtype, device=x.device)
        y2 = y.view(-1, b.shape[0])
        torch.matmul(x2, dequantize_nf4_scratch(packed, quant_state, dtype).t(), out=y2)
        if bias is not None:
            y2 += bias.to(dtype)
        xa = x2 @ a.t()
        y2.addmm_(xa, b.t(), alpha=scale)
        ctx.save_for_backward(x2, xa, lora_a, lora_b, packed)
        ctx.quant_state, ctx.scale, ctx.x_shape = quant_state, scale, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, xa, lora_a, lora_b, packed = ctx.saved_tensors
        scale, dtype = ctx.scale, x2.dtype
        dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype)
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        dyb = dy2 @ b  # [tokens, r]
        d_a = d_b = dx = None
        if ctx.needs_input_grad[5]:
            d_b = (dy2.t() @ xa).mul_(scale).to(lora_b.dtype)
        if ctx.needs_input_grad[4]:
            d_a = (dyb.t() @ x2).mul_(scale).to(lora_a.dtype)
        if ctx.needs_input_grad[0]:
            dx = dy2 @ dequantize_nf4_scratch(packed, ctx.quant_state, dtype)
            dx.addmm_(dyb, a, alpha=scale)
            dx = dx.view(ctx.x_shape)
        return dx, None, None, None, d_a, d_b, None


def lora_nf4_linear(x: torch.Tensor, packed: torch.Tensor, quant_state, bias: torch.Tensor | None,
                    lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """`x W^T + bias + scale * (x A^T) B^T` with W an NF4 weight; gradients for x, A and B only.

    Args:
        x: [..., in] activations; the matmuls run in its dtype.
        packed, quant_state: the bitsandbytes `Params4bit` data and its `QuantState` (shape [out, in]).
        bias: optional [out] frozen bias of the base layer.
        lora_a: [r, in]; lora_b: [out, r]; any float dtype (peft keeps them fp32), grads in that dtype.
        scale: LoRA scaling (alpha / r, or alpha / sqrt(r) with rsLoRA).
    """
    return _LoRANF4Fn.apply(x, packed, quant_state, bias, lora_a, lora_b, scale)


def reference_lora_nf4_linear(x: torch.Tensor, packed: torch.Tensor, quant_state, bias: torch.Tensor | None,
                              lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """bitsandbytes dequantization plus plain autograd matmuls; LoRA in the adapters' dtype, as in peft."""
    import bitsandbytes.functional as bnbf

    w = bnbf.dequantize_4bit(packed, quant_state, quant_type="nf4").to(x.dtype)
    y = torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    lora = (x.to(lora_a.dtype) @ lora_a.t()) @ lora_b.t() * scale
    return y + lora.to(x.dtype)
