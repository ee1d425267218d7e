"""NF4 dequantization in Triton, bit-exact with `bitsandbytes.functional.dequantize_4bit`.

The LoRA linear dequantizes each frozen 4-bit weight twice per step (forward and backward) and
throws it away; writing into one reused scratch buffer per (device, dtype) keeps that transient at
the size of the largest weight (4096 x 14336 bf16 = 112 MiB for Llama-3.1-8B) instead of one
allocation per layer.

Exactness: bitsandbytes computes each value as `fp32(code[nibble] * absmax[block])` rounded once to
the output dtype, and, with double quantization, `absmax = fp32(code2[q] * absmax2[q_block])`, then
`+ offset` as a separate operation. The GPU compiler would fuse `a * b + c` into one FMA (one rounding
instead of two), so the kernel is compiled with `enable_fp_fusion=False`: bitsandbytes' two roundings, and
the absmax computed in the same launch (the step around this kernel is often bound by the host's launches).

No host sync: the offset is a 0-d tensor on the GPU and the kernel loads it there. Reading it on the
host (`float(offset)`) once cost a device sync per dequantization, 21 per decoder layer per training
step: profiled on an H100, the GPU then sat idle 0.39 s of a 1.18 s 8B step at batch 4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_device
from ._rounding import bf16_rtne_bits
from .scratch import BUFFERS, VIEWS

_BYTES_PER_PROGRAM = 1024  # 2048 outputs per program: 4 KiB of bf16 stores, enough to hide latency
_BYTES_PER_PROGRAM_INTERPRETED = 16384  # the interpreter runs programs one by one: fewer, larger ones


@triton.jit
def _nf4_kernel(
    packed_ptr,
    absmax_ptr,
    code_ptr,
    out_ptr,
    n_out,
    code2_ptr,
    absmax2_ptr,
    offset_ptr,
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK2: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BLOCK + tl.arange(0, BLOCK)
    bmask = byte * 2 < n_out
    packed = tl.load(packed_ptr + byte, mask=bmask, other=0).to(tl.int32)
    block = (byte * 2) // BLOCKSIZE
    if NESTED:  # absmax itself is 8-bit: code2[q] * absmax2[block of blocks], then + offset (two roundings)
        q = tl.load(absmax_ptr + block, mask=bmask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q, mask=bmask, other=0.0) * tl.load(absmax2_ptr + block // BLOCK2, mask=bmask)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=bmask, other=0.0)
    hi = tl.load(code_ptr + (packed >> 4)) * scale  # high nibble holds the even element
    lo = tl.load(code_ptr + (packed & 15)) * scale
    vals = tl.reshape(tl.join(hi, lo), [2 * BLOCK])
    if BF16_BITS:
        vals = bf16_rtne_bits(vals)  # bitsandbytes rounds to nearest even; the interpreter's cast truncates
    else:
        vals = vals.to(out_ptr.dtype.element_ty)
    out_offs = pid * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, vals, mask=out_offs < n_out)


def dequantize_nf4(packed: torch.Tensor, quant_state, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a bitsandbytes NF4 weight (packed uint8 plus its `QuantState`).

    Args:
        packed: the `Params4bit` data, two 4-bit codes per byte, high nibble first.
        quant_state: its `bitsandbytes.functional.QuantState` (nested/double-quantized or not).
        out: optional destination with `quant_state.shape`; default a new tensor of `quant_state.dtype`.
    """
    shape = tuple(quant_state.shape)
    if out is None:
        out = torch.empty(shape, dtype=quant_state.dtype, device=packed.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"dequantize_nf4: out must be contiguous with shape {shape}, got {tuple(out.shape)}")
    _dequantize_into(packed, quant_state, out, out.view(torch.int16) if out.dtype == torch.bfloat16 else out)
    return out


def _dequantize_into(packed: torch.Tensor, quant_state, out: torch.Tensor, out_bits: torch.Tensor) -> None:
    """The launch behind both entry points; `out_bits` is `out` viewed as int16 when it is bf16.

    Every tensor op that would return its input unchanged (a `.to` to the dtype and device it has, a reshape
    of a flat tensor) is skipped in Python: at ~20 dequantizations per decoder layer per step, each such op
    was ~20 host-bound aten dispatches per layer (benchmarks/host_costs.py counts).
    """
    check_device(packed)
    if quant_state.quant_type != "nf4":
        raise ValueError(f"dequantize_nf4 got quant_type {quant_state.quant_type!r}; only nf4 is supported")
    device = packed.device
    if not packed.is_contiguous():
        packed = packed.reshape(-1)  # the kernel reads bytes by flat index
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    n_out = out.numel()
    per_program = _BYTES_PER_PROGRAM if device.type == "cuda" else _BYTES_PER_PROGRAM_INTERPRETED
    grid = (triton.cdiv(n_out, 2 * per_program),)
    state2 = quant_state.state2 if getattr(quant_state, "nested", False) else None
    absmax = quant_state.absmax
    if state2 is None:
        absmax = _on(absmax, device)
        code2 = absmax2 = offset = absmax  # placeholders: NESTED is False, never read
    else:
        code2, absmax2 = _on(state2.code, device), state2.absmax
        offset = quant_state.offset
        if not isinstance(offset, torch.Tensor):  # a float: fp32 whatever the default dtype
            offset = torch.tensor(offset, dtype=torch.float32)
        offset = _on(offset, device)
    _nf4_kernel[grid](
        packed,
        absmax,
        _on(quant_state.code, device),
        out_bits,
        n_out,
        code2,
        absmax2,
        offset,
        BLOCKSIZE=quant_state.blocksize,
        NESTED=state2 is not None,
        BLOCK2=state2.blocksize if state2 is not None else 1,
        BF16_BITS=out_bits is not out,
        BLOCK=per_program,
        num_warps=4,
        enable_fp_fusion=False,  # a * b + c as one FMA would round once where bitsandbytes rounds twice
    )


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` as fp32 on `device`, without an aten call when it already is."""
    return t if t.dtype == torch.float32 and t.device == device else t.to(device, torch.float32)


def dequantize_nf4_scratch(
    packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None, transposed: bool = False
) -> torch.Tensor:
    """Dequantize into the shared scratch buffer for (device, dtype) and return a view of it (its transpose
    with `transposed`, the layout a forward matmul reads).

    The view is valid until the next call on the same device and dtype: use it for one matmul and
    drop it (the LoRA linear's forward and backward do exactly that). The views of each weight shape are
    made once per buffer (`scratch.VIEWS`), not sliced, viewed and transposed at every call.
    """
    dtype = dtype or quant_state.dtype
    shape = tuple(quant_state.shape)
    key = (packed.device, dtype)
    views = VIEWS.get(key, {}).get(shape)
    if views is None:
        views = _scratch_views(key, shape)
    w, w_t, w_bits = views
    if dtype == quant_state.dtype:
        _dequantize_into(packed, quant_state, w, w_bits)
    else:
        w.copy_(dequantize_nf4(packed, quant_state))
    return w_t if transposed else w


def _scratch_views(key: tuple[torch.device, torch.dtype], shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """(weight, its transpose, its int16 bits or itself) over the scratch buffer, grown first if too small."""
    numel = 1
    for s in shape:
        numel *= s
    buf = BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        VIEWS.pop(key, None)  # the old buffer's views, which would keep it alive
        BUFFERS.pop(key, None)  # drop the old buffer before allocating the bigger one
        buf = BUFFERS[key] = torch.empty(numel, dtype=key[1], device=key[0])
    w = buf[:numel].view(shape)
    views = (w, w.t(), w.view(torch.int16) if w.dtype == torch.bfloat16 else w)
    VIEWS.setdefault(key, {})[shape] = views
    return views


def reference_dequantize_nf4(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' own dequantization: the ground truth the kernel must match bit for bit."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(packed, quant_state, quant_type="nf4")
