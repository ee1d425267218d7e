"""Our chunked gated delta rule (slimtune.train.step.delta_rule) against transformers' torch path: the same math
with fewer launches, so outputs and input gradients agree to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from slimtune.train.step.delta_rule import CHUNK, chunk_gated_delta_rule, unit_lower_inverse


@pytest.mark.parametrize("length", [64, 150])  # whole chunks, and a padded last chunk
def test_outputs_and_gradients_equal_transformers_torch_path(length):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    torch.manual_seed(0)
    rows, heads, dim = 2, 3, 16
    q, k, v = (torch.randn(rows, length, heads, dim) for _ in range(3))
    g = -torch.rand(rows, length, heads) * 0.5
    g[:, length // 2] = -30.0  # a document start inside a chunk, as the packed forward marks it
    beta = torch.rand(rows, length, heads)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    theirs = torch_chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)[0]
    ours = chunk_gated_delta_rule(*inputs)
    assert ours.shape == theirs.shape == (rows, length, heads, dim)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    weights = torch.randn_like(theirs)
    for a, b in zip(
        torch.autograd.grad((ours * weights).sum(), inputs),
        torch.autograd.grad((theirs * weights).sum(), inputs),
        strict=True,
    ):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_reset_start_forgets_what_came_before():
    """A token whose log decay is -30 starts from (almost) nothing: the output after it does not depend on the
    tokens before it."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 100, 2, 8) for _ in range(3))
    g, beta = -torch.rand(1, 100, 2) * 0.2, torch.rand(1, 100, 2)
    g[:, 40] = -30.0
    before = chunk_gated_delta_rule(q, k, v, g, beta)
    v2 = v.clone()
    v2[:, :40] = torch.randn(1, 40, 2, 8) * 10
    after = chunk_gated_delta_rule(q, k, v2, g, beta)
    assert (before[:, :40] - after[:, :40]).abs().max() > 1e-2
    torch.testing.assert_close(before[:, 40:], after[:, 40:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [1, 2, 8, CHUNK])
def test_unit_lower_inverse_equals_a_triangular_solve(size):
    """The explicit inverse the rule multiplies by solves what the triangular solve it replaced solved: only the
    strictly lower part is read (the diagonal taken as 1), and its product with the matrix is the identity."""
    torch.manual_seed(2)
    matrix = torch.randn(3, 2, size, size, dtype=torch.float64) * 0.2  # entries like k_beta k^T's with decay
    inverse = unit_lower_inverse(matrix)
    identity = torch.eye(size, dtype=torch.float64).expand_as(matrix)
    solved = torch.linalg.solve_triangular(matrix, identity, upper=False, unitriangular=True)
    torch.testing.assert_close(inverse, solved, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(inverse @ (matrix.tril(-1) + identity), identity, atol=1e-12, rtol=0)
    assert torch.equal(unit_lower_inverse(matrix + torch.randn_like(matrix).triu()), inverse)
