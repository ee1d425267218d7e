"""In-place RoPE against transformers' out-of-place formula, with per-token cos/sin and packed positions."""

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from slimtune.kernels.rope import reference_rope, rope_

B, T, HQ, HK, D = 2, 6, 4, 2, 16


def _table(n_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(n_pos).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _grads(fn, q_lin, k, cs, gq, gk):
    q_lin = q_lin.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    # q as a view of a projection output, the way attention produces it
    qo, ko = fn((q_lin * 1).view(B, T, HQ, D), k * 1, *cs)
    ((qo * gq).sum() + (ko * gk).sum()).backward()
    return qo.detach(), ko.detach(), q_lin.grad, k.grad


@pytest.mark.parametrize("mode", ["packed_position_ids", "per_token_cos_sin", "broadcast_batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_matches_reference(mode, dtype):
    torch.manual_seed(0)
    cos, sin = _table(16, D)
    # second row packs two examples: positions restart at 0 inside the row
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])
    if mode == "packed_position_ids":
        cs = (cos.to(dtype), sin.to(dtype), pos)
    elif mode == "per_token_cos_sin":
        cs = (cos[pos].to(dtype), sin[pos].to(dtype), None)  # what HF's rotary embedding returns
    else:
        cs = (cos[:T].unsqueeze(0).to(dtype), sin[:T].unsqueeze(0).to(dtype), None)
    q_lin = torch.randn(B, T, HQ * D, dtype=dtype)
    k = torch.randn(B, T, HK, D, dtype=dtype)
    gq, gk = torch.randn(B, T, HQ, D, dtype=dtype), torch.randn(B, T, HK, D, dtype=dtype)
    got = _grads(rope_, q_lin, k, cs, gq, gk)
    ref = _grads(reference_rope, q_lin, k, cs, gq, gk)
    # fp32: identical operations, 1e-6 covers fma contraction on GPU; bf16: one rounding each side (2**-7)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_rope_packed_positions_restart():
    """A packed example rotates exactly as if it started its own row."""
    cos, sin = _table(8, D)
    x = torch.randn(1, 3, HQ, D)
    packed_q = torch.cat([torch.randn(1, 2, HQ, D), x], dim=1)
    alone_q = x.clone()
    packed_k, alone_k = packed_q[:, :, :HK].clone(), alone_q[:, :, :HK].clone()
    rope_(packed_q, packed_k, cos, sin, torch.tensor([[0, 1, 0, 1, 2]]))
    rope_(alone_q, alone_k, cos, sin, torch.tensor([[0, 1, 2]]))
    assert torch.equal(packed_q[:, 2:], alone_q)
    assert not torch.equal(alone_q, x)  # it did rotate


def test_rope_is_in_place():
    cos, sin = _table(T, D)
    q, k = torch.randn(B, T, HQ, D), torch.randn(B, T, HK, D)
    qo, ko = rope_(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()


def _graph_nodes(fn) -> set[str]:
    seen, todo = set(), [fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def test_rope_on_whole_projection_outputs_matches_and_needs_no_copy_slices():
    """The attention patch hands rope_ the projection outputs [B, T, H*D] themselves, not views of them: the
    same values and gradients as the reference, and autograd records no CopySlices (a clone and a copy of
    q and k per backward), which rotating a view in place makes it record."""
    torch.manual_seed(1)
    cos, sin = _table(16, D)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])
    x = torch.randn(B, T, 8)
    wq, wk = torch.randn(HQ * D, 8, requires_grad=True), torch.randn(HK * D, 8, requires_grad=True)
    gq, gk = torch.randn(B, T, HQ, D), torch.randn(B, T, HK, D)

    def run(fn, whole: bool):
        q, k = x @ wq.t(), x @ wk.t()
        if not whole:
            q, k = q.view(B, T, HQ, D), k.view(B, T, HK, D)
        qo, ko = fn(q, k, cos, sin, pos) if fn is rope_ else fn(q.view(B, T, HQ, D), k.view(B, T, HK, D), cos, sin, pos)
        loss = (qo * gq).sum() + (ko * gk).sum()
        nodes = _graph_nodes(loss.grad_fn)
        grads = torch.autograd.grad(loss, (wq, wk))
        return qo.shape, ko.shape, qo.detach(), ko.detach(), grads, nodes

    *got, got_nodes = run(rope_, whole=True)
    *ref, _ = run(reference_rope, whole=True)
    assert tuple(got[:2]) == tuple(ref[:2]) == (torch.Size([B, T, HQ, D]), torch.Size([B, T, HK, D]))
    torch.testing.assert_close(got[2:4], ref[2:4], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[4], ref[4], rtol=1e-5, atol=1e-5)
    assert "CopySlices" not in got_nodes
    *_, view_nodes = run(rope_, whole=False)
    assert "CopySlices" in view_nodes  # the check can fail: rotating views in place records it
