"""The lm_head streamed from host memory in vocabulary chunks (one pass, online softmax) against full logits."""

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from slimtune.kernels.fused_linear_ce import reference_linear_cross_entropy
from slimtune.kernels.host_lm_head import head_chunk_rows, host_head_cross_entropy, host_head_logits

N, H, V = 37, 32, 300


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    # the last rows' logits grow chunk by chunk, so the running max moves in every chunk and rescales the sums
    weight[:, 0] += torch.linspace(0, 4, V).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = -100  # a completion-only mask: every third token is prompt
    labels[1], labels[2] = 0, V - 1  # the first and the last vocabulary row
    return hidden, weight, labels


def _run(loss_fn, hidden, weight, labels, **kw):
    hidden = hidden.detach().clone().requires_grad_()
    loss = loss_fn(hidden, weight, labels, **kw)
    (3.0 * loss).backward()  # a non-unit upstream gradient must scale the gradient
    return loss.detach(), hidden.grad


@pytest.mark.parametrize("chunk_rows", [16, 64, 299, 300, None])
def test_streamed_head_fp32_matches_full_logits(chunk_rows):
    hidden, weight, labels = _data(torch.float32)
    got = _run(host_head_cross_entropy, hidden, weight, labels, chunk_rows=chunk_rows)
    ref = _run(reference_linear_cross_entropy, hidden, weight, labels)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_streamed_head_bf16_within_rounding():
    hidden, weight, labels = _data(torch.bfloat16, seed=1)
    loss, dh = _run(host_head_cross_entropy, hidden, weight, labels, chunk_rows=32)
    ref_loss, ref_dh = _run(reference_linear_cross_entropy, hidden.float(), weight.float(), labels)
    # bf16 logits and probabilities (as `fused_linear_ce` rounds them): the bounds of its own bf16 test
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dh.float(), ref_dh, rtol=2**-5, atol=2e-3)


def test_ignored_tokens_the_divisor_and_no_gradient_outside_training():
    hidden, weight, labels = _data(torch.float32)
    _, dh = _run(host_head_cross_entropy, hidden, weight, labels, chunk_rows=16)
    assert torch.all(dh[labels == -100] == 0) and torch.all(dh[labels != -100].abs().sum(-1) > 0)
    loss, dh = _run(host_head_cross_entropy, hidden, weight, torch.full((N,), -100), chunk_rows=16)
    assert loss.item() == 0.0 and torch.all(dh == 0)
    n = int((labels != -100).sum())
    trained = hidden.clone().requires_grad_()  # the gradient's pass, as training runs it
    mean = host_head_cross_entropy(trained, weight, labels, chunk_rows=16)
    summed = host_head_cross_entropy(trained, weight, labels, chunk_rows=16, num_items_in_batch=1)
    torch.testing.assert_close(summed, mean * n, rtol=1e-6, atol=1e-5)
    with torch.no_grad():  # evaluation: the loss alone, without the gradient's accumulator
        torch.testing.assert_close(host_head_cross_entropy(trained, weight, labels), mean.detach())


def test_streamed_logits_equal_the_plain_head_and_refuse_a_gradient():
    hidden, weight, _ = _data(torch.float32)
    torch.testing.assert_close(host_head_logits(hidden.view(1, N, H), weight), (hidden @ weight.t()).view(1, N, V))
    with pytest.raises(RuntimeError, match="through the fused loss"):  # its chunks are refilled: no autograd
        host_head_logits(hidden.requires_grad_(), weight)


def test_chunks_hold_32_mib_of_head_and_128_mib_of_logits():
    assert head_chunk_rows(2048, 128256, 4096, 2) == 4096  # 32 MiB of an 8B head
    assert head_chunk_rows(32768, 128256, 4096, 2) == 2048  # 128 MiB of logits bound it at long sequences
    assert head_chunk_rows(16, 300, 32, 4) == 300


def test_confident_predictions_keep_their_gradient_in_bf16():
    """At p_label ~0.97 the label's term p - 1 is small: rounding p to bf16 first left 4.7% error in d(hidden), where
    the fused loss (which rounds p - 1) has 1.35%. The streamed head computes it in float32: within 1.1x of that."""
    from slimtune.kernels.fused_linear_ce import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (N,), generator=g)
    rows = weight[labels]
    hidden = torch.randn(N, H, generator=g) * 0.1 + 12 * rows / rows.norm(dim=1, keepdim=True) ** 2
    _, ref = _run(reference_linear_cross_entropy, hidden, weight, labels)
    p = torch.softmax(hidden @ weight.t(), -1)[torch.arange(N), labels]
    assert p.min() > 0.8 and p.mean() > 0.95

    def error(fn, **kw):
        _, dh = _run(fn, hidden.bfloat16(), weight.bfloat16(), labels, **kw)
        return ((dh.float() - ref).norm() / ref.norm()).item()

    assert error(host_head_cross_entropy, chunk_rows=64) < 1.1 * error(fused_linear_cross_entropy)
