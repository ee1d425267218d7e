"""The chunked gated delta rule of Qwen3.5's Gated DeltaNet, in torch, with few launches per chunk.

transformers' torch path (`torch_chunk_gated_delta_rule`, used where flash-linear-attention is not installed)
scans the chunks of a row with seven ops per chunk, one of them an indexed write into the output: one layer's
forward is ~220 small launches at 2048 tokens (32 chunks), its backward several times that, and on a GPU the step
waits on the host. Here the scan keeps only what is sequential: per chunk the values the state does not already
predict (one batched matmul-add) and the next state (a scale and a matmul-add), three ops in all; the chunks'
outputs come after the loop from the stacked states in two batched matmuls. The math is transformers' (same chunk
size, fp32 inside; the triangular systems solved through an explicit inverse, `unit_lower_inverse`), so the two
agree to fp32 rounding: tests/test_delta_rule.py.

On a GPU the rule runs compiled, inside the whole mixer (`slimtune.train.step.deltanet_mixer`): forward + backward
of the rule alone at Qwen3.5-4B's widths and 4 x 2048 tokens took 44.2 ms through transformers' path, 31.4 ms
through this one eagerly and 12.4 ms compiled (H200, `python3 benchmarks/deltanet_speed.py --compile`).
"""

from __future__ import annotations

import torch

CHUNK = 64


def chunk_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Gated delta rule from a zero state, query and key L2-normalized: (B, T, H, dk/dv) in, (B, T, H, dv) out.

    `query`/`key` carry as many heads as `value`; `g` (log decay, <= 0) and `beta` are (B, T, H).
    """
    dtype = query.dtype
    rows, length, heads, dk = key.shape
    dv = value.shape[-1]
    query, key, value, beta, g = (x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g))
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    pad = -length % CHUNK
    if pad:
        query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    chunks = (length + pad) // CHUNK
    query, key, value = (x.reshape(rows, heads, chunks, CHUNK, -1) for x in (query, key, value))
    beta, g = (x.reshape(rows, heads, chunks, CHUNK) for x in (beta, g))
    k_beta = key * beta.unsqueeze(-1)
    cum = g.cumsum(-1)
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=query.device).triu(1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    inverse = unit_lower_inverse((k_beta @ key.transpose(-1, -2)) * pair_decay)
    fresh = inverse @ (value * beta.unsqueeze(-1))
    decayed = cum.exp().unsqueeze(-1)  # the decay from the chunk's start to each position
    reads = inverse @ (k_beta * decayed)
    within = (query @ key.transpose(-1, -2)) * pair_decay
    query = query * decayed
    writes = (key * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)  # (.., dk, CHUNK)
    carry = cum[..., -1].exp()[..., None, None]
    # (rows * heads) batches for baddbmm; one state per chunk, the state the chunk starts from
    flat = rows * heads
    fresh, reads, writes, carry = (x.reshape(flat, chunks, *x.shape[-2:]) for x in (fresh, reads, writes, carry))
    state = query.new_zeros(flat, dk, dv)
    states, news = [], []
    for i in range(chunks):
        states.append(state)
        new = torch.baddbmm(fresh[:, i], reads[:, i], state, alpha=-1)  # what the state does not predict
        news.append(new)
        state = torch.baddbmm(state * carry[:, i], writes[:, i], new)
    states = torch.stack(states, 1).reshape(rows, heads, chunks, dk, dv)
    news = torch.stack(news, 1).reshape(rows, heads, chunks, CHUNK, dv)
    out = query @ states + within @ news
    out = out.reshape(rows, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(dtype).contiguous()


def unit_lower_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """The inverse of the unit lower-triangular matrix whose strictly lower part is `matrix`'s (..., n, n; n a power
    of two; the diagonal and upper part are not read), built by doubling blocks: the inverse of [[A, 0], [C, B]] is
    [[A', 0], [-B' C A', B']] from the halves' inverses A', B'. A few batched matmuls per doubling, where a triangular
    solve (cuBLAS trsm) took a quarter of a compiled DeltaNet layer's time (H200, 4 x 2048 tokens); the two
    right-hand sides then cost one matmul each, and the backward is matmuls too."""
    *batch, n, _ = matrix.shape
    lower = matrix.tril(-1)
    inverse = torch.ones(*batch, n, 1, 1, dtype=matrix.dtype, device=matrix.device)  # the 1 x 1 diagonal blocks
    size = 1
    while size < n:
        pairs = n // (2 * size)
        halves = inverse.reshape(*batch, pairs, 2, size, size)
        first, second = halves[..., 0, :, :], halves[..., 1, :, :]
        # the diagonal blocks of twice the size, (..., pairs, 2 size, 2 size), and their lower-left quarters
        blocks = lower.reshape(*batch, pairs, 2 * size, pairs, 2 * size).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        corner = -(second @ blocks[..., size:, :size] @ first)
        top = torch.cat([first, torch.zeros_like(first)], -1)
        inverse = torch.cat([top, torch.cat([corner, second], -1)], -2)
        size *= 2
    return inverse.reshape(*batch, n, n)
