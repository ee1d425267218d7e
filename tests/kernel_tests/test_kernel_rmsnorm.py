"""RMSNorm kernel against its plain-torch reference, forward and backward (Llama and Gemma rules)."""

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from slimtune.kernels.rms_norm import reference_rms_norm, rms_norm


def _run(fn, x, w, gemma, dy):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = fn(x, w, 1e-6, gemma)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_fp32_matches_reference(gemma):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 200)  # 200 is not a power of two: exercises the masked tail
    w = torch.randn(200) * 0.2 + (0.0 if gemma else 1.0)
    dy = torch.randn(3, 5, 200)
    got, ref = _run(rms_norm, x, w, gemma, dy), _run(reference_rms_norm, x, w, gemma, dy)
    for a, b in zip(got, ref):
        # fp32 sums in a different order: a few ulps (1e-6 relative) apart; dw sums 15 rows
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_bf16_within_rounding(gemma):
    torch.manual_seed(1)
    x = torch.randn(4, 96).bfloat16()
    w = (torch.randn(96) * 0.2 + (0.0 if gemma else 1.0)).bfloat16()
    dy = torch.randn(4, 96).bfloat16()
    y, dx, dw = _run(rms_norm, x, w, gemma, dy)
    y32, dx32, dw32 = _run(reference_rms_norm, x.float(), w.float(), gemma, dy.float())
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits: 2**-7 relative per rounding; outputs are rounded twice in Llama's rule
    torch.testing.assert_close(y.float(), y32, rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(dx.float(), dx32, rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(dw.float(), dw32, rtol=2**-6, atol=2**-5)


def test_rms_norm_frozen_weight_has_no_grad_and_fp32_weight_promotes():
    # peft's prepare_model_for_kbit_training keeps norms in fp32 over bf16 activations
    x = torch.randn(6, 64).bfloat16().requires_grad_()
    w = torch.rand(64) + 0.5
    y = rms_norm(x, w, 1e-5)
    ref = reference_rms_norm(x, w, 1e-5)
    assert y.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)  # same bf16 rounding of x*rstd, then fp32
    y.sum().backward()
    assert x.grad is not None and w.grad is None
