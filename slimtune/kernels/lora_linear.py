"""LoRA linear over a frozen NF4 base: dequantize, matmul, add `scale * (x A^T) B^T`, hand-written backward.

Why not peft's path: for a bf16 model peft keeps the adapters in fp32, so each LoRA layer casts its
input to fp32 and saves that copy for backward (for `down_proj` at 4x2048 tokens: 8192 x 14336 x 4 B
= 448 MiB per layer recompute) and runs three separate autograd nodes. Here the adapters are cast to
the activation dtype (r=16: 2 x 16 x 14336 values, negligible), the base weight is dequantized by the
Triton NF4 kernel into one reused scratch buffer, and backward produces only what training needs:
d(input), d(A), d(B); the frozen base and its bias get no gradient.

The low-rank term is written first and the big matmul adds onto it (`addmm_`, beta = 1): cuBLAS
reads the addend in the epilogue of a compute-bound GEMM, where an `addmm_` of the low-rank term
after the big matmul is a separate memory-bound pass over the output (0.19 ms per gate projection
at 4x2048 tokens on an H200, ~50 ms of an 8B step).

`compute_output=False` is for a recomputation whose result is thrown away (the last projection of a
decoder layer re-run by "unsloth" checkpointing, whose output only feeds the discarded layer output
through a residual add): it saves what backward needs and skips the base matmul.
"""

from __future__ import annotations

import torch

from ._launch import apply_or_forward
from .nf4 import dequantize_nf4_scratch


class _LoRANF4Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, quant_state, bias, lora_a, lora_b, casts, scale: float, compute_output: bool):
        x2 = x.reshape(-1, x.shape[-1])
        dtype = x.dtype
        a, b = casts if casts is not None else adapters_in(lora_a, lora_b, dtype)
        xa = torch.nn.functional.linear(x2, a)  # x2 @ a.t() in one aten call, not two
        # the casts, not the adapters: backward multiplies in the activation dtype and need not cast again
        ctx.save_for_backward(x2, xa, a, b, packed)
        ctx.quant_state, ctx.scale, ctx.x_shape = quant_state, scale, x.shape
        ctx.grad_dtypes = lora_a.dtype, lora_b.dtype
        out_shape = (*x.shape[:-1], b.shape[0])
        if not compute_output:
            return x2.new_zeros(()).expand(out_shape)  # no memory; its values are never read
        # y is allocated in its final shape and written through a 2-D view: RoPE rotates q/k projections
        # in place, which autograd forbids on a view created inside a custom Function
        y = torch.empty(out_shape, dtype=dtype, device=x.device)
        y2 = y.view(-1, b.shape[0])
        # `scale` rides in the GEMM's alpha: no separate pass to scale a factor or a product
        if bias is None:
            y2.addmm_(xa, b.t(), beta=0, alpha=scale)  # beta=0: y2's uninitialized values are never read
        else:
            torch.addmm(bias.to(dtype), xa, b.t(), alpha=scale, out=y2)
        y2.addmm_(x2, dequantize_nf4_scratch(packed, quant_state, dtype, transposed=True))
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, xa, a, b, packed = ctx.saved_tensors
        scale, dtype = ctx.scale, x2.dtype
        a_dtype, b_dtype = ctx.grad_dtypes
        dy2 = dy.reshape(-1, dy.shape[-1])
        if dy2.dtype != dtype:
            dy2 = dy2.to(dtype)
        dyb = dy2.new_empty((dy2.shape[0], b.shape[1])).addmm_(dy2, b, beta=0, alpha=scale)  # scale * dy B: [tokens, r]
        d_a = d_b = dx = None
        if ctx.needs_input_grad[5]:
            d_b = _low_rank_grad(dy2.t(), xa, scale, b_dtype)
        if ctx.needs_input_grad[4]:
            d_a = _low_rank_grad(dyb.t(), x2, 1.0, a_dtype)
        if ctx.needs_input_grad[0]:
            dx = dyb @ a
            dx.addmm_(dy2, dequantize_nf4_scratch(packed, ctx.quant_state, dtype))
            dx = dx.view(ctx.x_shape)
        return dx, None, None, None, d_a, d_b, None, None, None


def _low_rank_grad(m1: torch.Tensor, m2: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """`alpha * m1 @ m2` in the adapter's `dtype`. On CUDA cuBLAS writes it in that dtype (fp32 accumulators
    stored as they are: one launch, no bf16 rounding) where a matmul in the activation dtype and a cast were
    two launches per adapter, 224 of ~3,000 in a 1B step (benchmarks/profile_step.py launch sources)."""
    shape = (m1.shape[0], m2.shape[1])
    if m1.is_cuda and dtype == torch.float32 and m1.dtype in (torch.bfloat16, torch.float16):
        return torch.addmm(m1.new_empty(shape, dtype=dtype), m1, m2, out_dtype=dtype, beta=0, alpha=alpha)
    product = m1.new_empty(shape).addmm_(m1, m2, beta=0, alpha=alpha)
    return product if product.dtype == dtype else product.to(dtype)  # CPU: no mixed-dtype GEMM


def lora_nf4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    quant_state,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    compute_output: bool = True,
    casts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`x W^T + bias + scale * (x A^T) B^T` with W an NF4 weight; gradients for x, A and B only.

    Args:
        x: [..., in] activations; the matmuls run in its dtype.
        packed, quant_state: the bitsandbytes `Params4bit` data and its `QuantState` (shape [out, in]).
        bias: optional [out] frozen bias of the base layer.
        lora_a: [r, in]; lora_b: [out, r]; any float dtype (peft keeps them fp32), grads in that dtype.
        scale: LoRA scaling (alpha / r, or alpha / sqrt(r) with rsLoRA).
        compute_output: False returns zeros (a stride-0 view) and skips the base matmul, for a
            recomputation whose output is discarded; the gradients are the same.
        casts: `adapters_in(lora_a, lora_b, x.dtype)` made earlier, to reuse (a checkpointed layer's
            recompute reuses its forward's); default: cast here.
    """
    return apply_or_forward(_LoRANF4Fn, x, packed, quant_state, bias, lora_a, lora_b, casts, scale, compute_output)


def adapters_in(lora_a: torch.Tensor, lora_b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapters cast to the activation dtype, outside autograd (their gradients come from the Function)."""
    return lora_a.detach().to(dtype), lora_b.detach().to(dtype)


def adapters_in_bulk(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`adapters_in` for many layers in one multi-tensor copy: a few launches on CUDA, not one per adapter."""
    sources = [t for pair in pairs for t in pair]
    casts = [torch.empty_like(t, dtype=dtype) for t in sources]
    with torch.no_grad():
        torch._foreach_copy_(casts, sources)
    return list(zip(casts[0::2], casts[1::2], strict=True))


def reference_lora_nf4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    quant_state,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """bitsandbytes dequantization plus plain autograd matmuls; LoRA in the adapters' dtype, as in peft."""
    import bitsandbytes.functional as bnbf

    w = bnbf.dequantize_4bit(packed, quant_state, quant_type="nf4").to(x.dtype)
    y = torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    lora = (x.to(lora_a.dtype) @ lora_a.t()) @ lora_b.t() * scale
    return y + lora.to(x.dtype)
