"""NF4 dequantization bit for bit against bitsandbytes; the fused LoRA linear against plain autograd."""

import gc
import os
import weakref

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bitsandbytes.functional as bnbf
import pytest

from slimtune.kernels.lora_linear import lora_nf4_linear, reference_lora_nf4_linear
from slimtune.kernels.nf4 import dequantize_nf4, dequantize_nf4_scratch
from slimtune.kernels.scratch import BUFFERS, VIEWS, release_scratch


def _quantize(shape, dtype, double_quant=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * 0.05).to(dtype)
    return bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain_absmax"])
def test_dequantize_bit_exact_with_bitsandbytes(dtype, double_quant):
    # 96 x 520: 780 absmax blocks -> 4 second-level blocks of 256, the last one partial
    packed, state = _quantize((96, 520), dtype, double_quant)
    got = dequantize_nf4(packed, state)
    ref = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    assert torch.equal(_bits(got), _bits(ref))


def test_float_offset_is_read_as_fp32_whatever_the_default_dtype():
    # a QuantState built by hand may carry its double-quant offset as a Python float; under a bf16 default
    # dtype (as when a model is built in bf16) making it a tensor must not round it to bf16
    packed, state = _quantize((64, 128), torch.bfloat16)
    ref = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
    state.offset = float(state.offset)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = dequantize_nf4(packed, state)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(_bits(got), _bits(ref))


def test_odd_element_count_and_scratch_reuse():
    release_scratch()
    packed_a, state_a = _quantize((9, 7), torch.bfloat16, seed=1)  # 63 values: half a byte of padding
    packed_b, state_b = _quantize((16, 64), torch.bfloat16, seed=2)
    a = dequantize_nf4_scratch(packed_a, state_a)
    assert torch.equal(_bits(a), _bits(bnbf.dequantize_4bit(packed_a, state_a)))
    b = dequantize_nf4_scratch(packed_b, state_b)
    c = dequantize_nf4_scratch(packed_a, state_a)
    assert c.data_ptr() == b.data_ptr()  # the smaller weight reuses the grown buffer
    assert torch.equal(_bits(c), _bits(bnbf.dequantize_4bit(packed_a, state_a)))
    release_scratch()


def test_scratch_views_transposed_and_released_with_their_buffer():
    release_scratch()
    packed_a, state_a = _quantize((9, 7), torch.bfloat16, seed=1)
    packed_b, state_b = _quantize((16, 64), torch.bfloat16, seed=2)
    ref_a = bnbf.dequantize_4bit(packed_a, state_a)
    t = dequantize_nf4_scratch(packed_a, state_a, transposed=True)
    assert t.shape == (7, 9) and torch.equal(_bits(t), _bits(ref_a.t()))
    as_fp32 = dequantize_nf4_scratch(packed_a, state_a, torch.float32)  # another dtype: its own buffer
    assert as_fp32.dtype == torch.float32 and torch.equal(as_fp32, ref_a.float())
    key = (packed_a.device, torch.bfloat16)
    small = weakref.ref(BUFFERS[key])
    del t
    dequantize_nf4_scratch(packed_b, state_b)  # grows the bf16 buffer: the cached views of the old one go too
    gc.collect()
    assert small() is None, "a cached view kept the outgrown scratch buffer alive"
    grown = weakref.ref(BUFFERS[key])
    release_scratch()
    gc.collect()
    assert grown() is None and not VIEWS and not BUFFERS


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_matches_reference_fp32(bias):
    torch.manual_seed(0)
    out_f, in_f, r = 48, 64, 4
    packed, state = _quantize((out_f, in_f), torch.float32)
    x = torch.randn(2, 5, in_f)
    b = torch.randn(out_f) if bias else None
    lora_a, lora_b = torch.randn(r, in_f) * 0.1, torch.randn(out_f, r) * 0.1
    dy = torch.randn(2, 5, out_f)
    results = []
    for fn in (lora_nf4_linear, reference_lora_nf4_linear):
        xi = x.clone().requires_grad_()
        ai, bi = lora_a.clone().requires_grad_(), lora_b.clone().requires_grad_()
        y = fn(xi, packed, state, b, ai, bi, 2.0)
        y.backward(dy)
        results.append((y.detach(), xi.grad, ai.grad, bi.grad))
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # fp32 matmuls in another order


def test_lora_linear_bf16_activations_fp32_adapters():
    """peft keeps adapters fp32 over a bf16 model: grads come back fp32, close to an fp32 computation."""
    torch.manual_seed(1)
    packed, state = _quantize((32, 64), torch.bfloat16)
    x = torch.randn(6, 64).bfloat16().requires_grad_()
    lora_a = (torch.randn(8, 64) * 0.1).requires_grad_()
    lora_b = (torch.randn(32, 8) * 0.1).requires_grad_()
    y = lora_nf4_linear(x, packed, state, None, lora_a, lora_b, 0.5)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and lora_a.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    x32, a32, b32 = (t.detach().float().requires_grad_() for t in (x, lora_a, lora_b))
    w32 = bnbf.dequantize_4bit(packed, state).float()
    y32 = x32 @ w32.t() + 0.5 * (x32 @ a32.t()) @ b32.t()
    y32.backward(dy.float())
    # bf16 operands (8 bits) with fp32 accumulation over 64 terms: a few 2**-8 relative
    torch.testing.assert_close(y.float(), y32, rtol=2**-5, atol=2e-2)
    for got, ref in ((x.grad, x32.grad), (lora_a.grad, a32.grad), (lora_b.grad, b32.grad)):
        torch.testing.assert_close(got.float(), ref, rtol=2**-5, atol=2e-2)
