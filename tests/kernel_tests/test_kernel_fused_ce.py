"""Chunked linear + cross-entropy against full-logits cross-entropy, forward and backward."""

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from slimtune.kernels.fused_linear_ce import (
    CHUNK_BYTES_CAP,
    causal_lm_loss,
    chunk_tokens_for,
    fused_linear_cross_entropy,
    reference_linear_cross_entropy,
)

N, H, V = 37, 32, 300  # 37 tokens over chunks of 16: the last chunk is partial


def _run(loss_fn, hidden, weight, labels, **kw):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = loss_fn(hidden, weight, labels, **kw)
    (3.0 * loss).backward()  # a non-unit upstream gradient must scale both grads
    return loss.detach(), hidden.grad, weight.grad


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = -100  # a completion-only mask: every third token is prompt
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [16, None])
def test_fused_ce_fp32_matches_full_logits(chunk):
    hidden, weight, labels = _data(torch.float32)
    got = _run(fused_linear_cross_entropy, hidden, weight, labels, chunk_tokens=chunk)
    ref = _run(reference_linear_cross_entropy, hidden, weight, labels)
    for a, b in zip(got, ref):
        # fp32: logsumexp in a different order, relative error ~1e-7
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_ce_bf16_within_rounding():
    hidden, weight, labels = _data(torch.bfloat16, seed=1)
    loss, dh, dw = _run(fused_linear_cross_entropy, hidden, weight, labels, chunk_tokens=16)
    ref_loss, ref_dh, ref_dw = _run(reference_linear_cross_entropy, hidden.float(), weight.float(), labels)
    # logits are bf16 (as HF's lm_head produces them): each off by up to 2**-8 relative, ~0.02 absolute
    # here; the mean loss averages those errors, the gradients carry one more bf16 rounding
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dh.float(), ref_dh, rtol=2**-5, atol=2e-3)
    torch.testing.assert_close(dw.float(), ref_dw, rtol=2**-5, atol=2e-3)


def test_ignored_tokens_get_zero_gradient_and_all_ignored_gives_zero():
    hidden, weight, labels = _data(torch.float32)
    _, dh, _ = _run(fused_linear_cross_entropy, hidden, weight, labels, chunk_tokens=8)
    assert torch.all(dh[labels == -100] == 0) and torch.all(dh[labels != -100].abs().sum(-1) > 0)
    loss, dh, dw = _run(fused_linear_cross_entropy, hidden, weight, torch.full((N,), -100))
    assert loss.item() == 0.0 and torch.all(dh == 0) and torch.all(dw == 0)


def test_num_items_in_batch_sets_the_divisor():
    hidden, weight, labels = _data(torch.float32)
    mean = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    summed = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=16, num_items_in_batch=1)
    n = int((labels != -100).sum())
    torch.testing.assert_close(summed, mean * n, rtol=1e-6, atol=1e-5)


def test_frozen_head_gets_no_gradient_and_causal_shift_matches_hf():
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, labels = _data(torch.float32)
    hidden = hidden.view(1, N, H).requires_grad_()
    labels = labels.view(1, N)
    loss = causal_lm_loss(hidden, weight, labels)
    ref = ForCausalLMLoss(hidden @ weight.t(), labels, vocab_size=V)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert hidden.grad is not None and weight.grad is None


def test_chunk_size_bounded_by_budget():
    rows = chunk_tokens_for(8192, 128256, torch.bfloat16, torch.device("cpu"))
    assert rows * 128256 * 2 <= CHUNK_BYTES_CAP and rows % 128 == 0 and rows >= 128
    assert chunk_tokens_for(10, 128256, torch.bfloat16, torch.device("cpu")) == 10


def test_evaluation_under_no_grad_gives_the_same_loss():
    hidden, weight, labels = _data(torch.float32)
    hidden.requires_grad_()
    with torch.no_grad():
        evaluated = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    trained = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    assert not evaluated.requires_grad and trained.requires_grad
    torch.testing.assert_close(evaluated, trained.detach(), rtol=0, atol=0)
