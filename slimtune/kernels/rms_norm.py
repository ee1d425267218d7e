"""RMSNorm forward and backward in Triton, matching Llama's and Gemma's casting rules.

Eager RMSNorm saves the fp32 upcast input, the normalised tensor and the rsqrt: three activations per
norm. The kernel saves the input in its own dtype plus one fp32 rstd per row, and runs as one pass per
row instead of five elementwise kernels.

Two casting rules exist in Hugging Face models and we keep both exactly:
- Llama/Mistral/Qwen: `weight * (x * rstd).to(x.dtype)` (output dtype is the promotion of weight and x).
- Gemma: `((x * rstd) * (1 + weight.float())).to(x.dtype)` (weight stored as an offset from 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import apply_or_forward, check_device, program_count, row_block
from ._rounding import bf16_rtne


@triton.jit
def _rms_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    n_cols,
    x_stride,
    y_stride,
    eps,
    GEMMA: tl.constexpr,
    X_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_raw = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    if GEMMA:
        y = x * rstd * (1.0 + w)
    else:
        # round the normalised value to the input dtype first, as Llama's forward does
        if X_BF16:
            y = w * bf16_rtne(x * rstd)
        else:
            y = w * (x * rstd).to(x_raw.dtype).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    n_rows,
    n_cols,
    dy_stride,
    x_stride,
    dx_stride,
    rows_per_program,
    GEMMA: tl.constexpr,
    NEED_DW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program  # int64: rows * stride can pass 2**31
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + row * dx_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += dy * xhat
    if NEED_DW:
        tl.store(dw_part_ptr + pid * n_cols + cols, dw_acc, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
        check_device(x)
        x2 = _rows(x)
        out_dtype = x.dtype if gemma else torch.result_type(weight, x)
        # allocated in x's shape, not viewed from 2-D: RoPE later rotates Qwen3's q_norm output in place,
        # and autograd forbids in-place writes to a view created inside a custom Function
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block, warps = row_block(x2.shape[1])
        _rms_fwd_kernel[(x2.shape[0],)](
            x2,
            weight,
            y,
            rstd,
            x2.shape[1],
            x2.stride(0),
            x2.shape[1],
            eps,
            GEMMA=gemma,
            X_BF16=x.dtype == torch.bfloat16,
            BLOCK=block,
            num_warps=warps,
        )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.gemma, ctx.shape = gemma, x.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = _rows(dy)
        n_rows, n_cols = x2.shape
        dx = torch.empty_like(x2)
        need_dw = ctx.needs_input_grad[1]
        programs = program_count(x2.device, n_rows)
        rows_per_program = triton.cdiv(n_rows, programs)
        programs = triton.cdiv(n_rows, rows_per_program)
        dw_part = (
            torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device) if need_dw else rstd
        )  # placeholder pointer, never written when NEED_DW is False
        block, warps = row_block(n_cols)
        _rms_bwd_kernel[(programs,)](
            dy2,
            x2,
            weight,
            rstd,
            dx,
            dw_part,
            n_rows,
            n_cols,
            dy2.stride(0),
            x2.stride(0),
            dx.stride(0),
            rows_per_program,
            GEMMA=ctx.gemma,
            NEED_DW=need_dw,
            BLOCK=block,
            num_warps=warps,
        )
        dw = dw_part.sum(0).to(weight.dtype) if need_dw else None
        return dx.view(ctx.shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension; `gemma=True` uses Gemma's `(1 + weight)` and casting rule."""
    return apply_or_forward(_RMSNormFn, x, weight, eps, gemma)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """Plain-torch RMSNorm, written as in transformers' Llama and Gemma modules."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).type_as(x)
    return weight * normed.to(x.dtype)
