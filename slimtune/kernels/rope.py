"""Rotary position embedding applied in place to q and k, forward and backward, in Triton.

Eager RoPE (`q * cos + rotate_half(q) * sin`) allocates four temporaries per tensor and saves cos/sin
broadcasts for backward. Rotating in place allocates nothing: the backward is the same rotation with
`-sin`, applied in place to the incoming gradient.

cos/sin come in one of two forms:
- per token, shape [B or 1, T, D] as Hugging Face's rotary embedding returns them (already gathered by
  `position_ids`, and already carrying any rope scaling / attention factor); or
- a table [P, D] plus `position_ids` [B, T]: each token reads row `position_ids[b, t]`, so packed rows
  whose positions restart at 0 rotate each example from its own start.
Both halves of a cos/sin row are equal in HF's layout (`cat(freqs, freqs)`); the kernel reads the first half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import apply_or_forward, check_device


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    seq_len,
    n_heads,
    x_stride_b,
    x_stride_t,
    x_stride_h,
    cs_stride_b,
    cs_stride_t,
    pos_stride_b,
    sign,
    HALF: tl.constexpr,
    HAS_POS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    if HAS_POS:
        row = tl.load(pos_ptr + b * pos_stride_b + t).to(tl.int64)
        cs_off = row * cs_stride_t
    else:
        cs_off = b.to(tl.int64) * cs_stride_b + t * cs_stride_t
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cos = tl.load(cos_ptr + cs_off + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off + d, mask=dmask, other=0.0).to(tl.float32) * sign
    h = tl.arange(0, BLOCK_H)
    base = x_ptr + b.to(tl.int64) * x_stride_b + t.to(tl.int64) * x_stride_t
    offs = h[:, None] * x_stride_h + d[None, :]
    mask = (h[:, None] < n_heads) & dmask[None, :]
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base + offs, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + offs + HALF, y2.to(x_ptr.dtype.element_ty), mask=mask)


def _rotate_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None, sign: float
) -> None:
    """Rotate `x` [B, T, H, D] (last dim contiguous) in place."""
    check_device(x)
    bsz, seq, heads, dim = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rope: the head dimension of q/k must be contiguous (stride 1)")
    if position_ids is None:
        if cos.dim() == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        cs_stride_b = 0 if cos.shape[0] == 1 else cos.stride(0)
        cs_stride_t, pos, pos_stride = cos.stride(1), cos, 0  # pos unused: HAS_POS is False
    else:
        cs_stride_b, cs_stride_t = 0, cos.stride(0)
        pos = position_ids.expand(bsz, seq)
        pos_stride = pos.stride(0)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
        return _rotate_(x, cos, sin, position_ids, sign)
    _rope_kernel[(bsz * seq,)](
        x,
        cos,
        sin,
        pos,
        seq,
        heads,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        cs_stride_b,
        cs_stride_t,
        pos_stride,
        sign,
        HALF=dim // 2,
        HAS_POS=position_ids is not None,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim // 2),
        num_warps=4,
    )


class _RopeFn(torch.autograd.Function):
    # One tensor per call: autograd refuses a Function that dirties a view and returns two tensors. A
    # projection output passed whole ([B, T, H*D], no view) is dirtied as it is: a view of it would make
    # autograd wrap this Function in CopySlices, a clone and copies of q and of k in every backward (128
    # copies of a 1B step, benchmarks/profile_step.py launch sources).
    @staticmethod
    def forward(ctx, x, cos, sin, position_ids):
        _rotate_(_heads(x, cos), cos, sin, position_ids, 1.0)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, position_ids)
        return x

    @staticmethod
    def backward(ctx, dx):
        cos, sin, position_ids = ctx.saved_tensors
        # autograd hands this Function a gradient buffer nothing else reads; a copy only if it is strided
        heads = _heads(dx if dx.stride(-1) == 1 else dx.contiguous(), cos)
        _rotate_(heads, cos, sin, position_ids, -1.0)
        return heads.reshape(dx.shape), None, None, None


def _heads(x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """`x` as [B, T, H, D], D being the rotary dimension (the last of `cos`): a view where strides allow."""
    return x if x.dim() == 4 else x.reshape(*x.shape[:2], -1, cos.shape[-1])


def rope_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place and return them as [B, T, H, D].

    Args:
        q, k: query/key states in token-major layout: [B, T, H, D], or the projection outputs themselves
            ([B, T, H*D], the head dimension being the last of `cos`: full rotary only), which autograd
            tracks more cheaply than a view of them. Their last dimension must be contiguous.
        cos, sin: [B or 1, T, D] per-token values, or a [P, D] table when `position_ids` is given.
        position_ids: [B, T] or [1, T] row index into the table; packed examples restart at 0.
    """
    q, k = apply_or_forward(_RopeFn, q, cos, sin, position_ids), apply_or_forward(_RopeFn, k, cos, sin, position_ids)
    return _heads(q, cos), _heads(k, cos)


def reference_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place RoPE as transformers computes it, in the same [B, T, H, D] layout."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    elif cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
