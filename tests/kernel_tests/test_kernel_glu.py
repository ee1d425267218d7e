"""Fused SwiGLU / GeGLU against eager `act(gate) * up`, forward and backward."""

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from slimtune.kernels.swiglu import ACTIVATIONS, gated_act, geglu, reference_gated_act, swiglu


def _run(fn, gate, up, act, dh):
    gate = gate.detach().clone().requires_grad_()
    up = up.detach().clone().requires_grad_()
    h = fn(gate, up, act)
    h.backward(dh)
    return h.detach(), gate.grad, up.grad


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gated_fp32_matches_reference(act):
    torch.manual_seed(0)
    gate = torch.randn(3, 7, 130) * 3  # |gate| up to ~10 reaches the saturated tails of sigmoid/tanh
    up, dh = torch.randn(3, 7, 130), torch.randn(3, 7, 130)
    for a, b in zip(_run(gated_act, gate, up, act, dh), _run(reference_gated_act, gate, up, act, dh)):
        # fp32; tanh is computed from exp in the kernel (|err| ~1e-7), torch uses its own tanh/erf
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gated_bf16_within_rounding(act):
    torch.manual_seed(1)
    gate = (torch.randn(5, 64) * 2).bfloat16()
    up, dh = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    got = _run(gated_act, gate, up, act, dh)
    ref = _run(reference_gated_act, gate.float(), up.float(), act, dh.float())
    assert all(t.dtype == torch.bfloat16 for t in got)
    for a, b in zip(got, ref):
        # act(g) is rounded to bf16 before the product (as eager does), then the product: two roundings,
        # each up to 2**-7 relative (truncating in the interpreter), hence 2**-6
        torch.testing.assert_close(a.float(), b, rtol=2**-6, atol=2**-6)


def test_named_wrappers_pick_the_activation():
    gate, up = torch.randn(4, 32), torch.randn(4, 32)
    torch.testing.assert_close(swiglu(gate, up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        geglu(gate, up), torch.nn.functional.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(geglu(gate, up, "none"), torch.nn.functional.gelu(gate) * up, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not supported"):
        gated_act(gate, up, "relu")


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_inplace_backward_same_gradients_and_no_extra_buffers(act):
    """The MLP patch's in-place backward: equal gradients, written into the (non-leaf) gate and up."""
    torch.manual_seed(2)
    g0, u0, dh = torch.randn(4, 96) * 2, torch.randn(4, 96), torch.randn(4, 96)
    expected = _run(gated_act, g0, u0, act, dh)

    g_leaf, u_leaf = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    gate, up = g_leaf * 1.0, u_leaf * 1.0  # intermediates, as projection outputs are
    h = gated_act(gate, up, act, inplace_backward=True)
    h.backward(dh)
    torch.testing.assert_close(h.detach(), expected[0], rtol=0, atol=0)
    torch.testing.assert_close(g_leaf.grad, expected[1], rtol=0, atol=0)
    torch.testing.assert_close(u_leaf.grad, expected[2], rtol=0, atol=0)
    # the gradients live in gate's and up's own storage: no new [tokens, intermediate] buffers
    torch.testing.assert_close(gate.detach(), expected[1], rtol=0, atol=0)
    torch.testing.assert_close(up.detach(), expected[2], rtol=0, atol=0)
