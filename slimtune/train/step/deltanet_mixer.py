"""Qwen3.5's Gated DeltaNet between its projections, on packed rows, as one function: compiled whole on a GPU.

What lies between the projections (the causal conv with its document-masked taps, the activation, the heads'
split and repeat, the gates, the chunked delta rule, the gated RMSNorm) is element-wise work around a few small
matmuls. Run op by op it was ~0.4 s of a 1.1 s Qwen3.5-4B step at 4 x 2048 (H200 profile,
benchmarks/results/profiles/h200-2026-11-27b-qwen35-4b-b4-product.json), reading and writing the 8192 conv
channels of every token several times over; compiled whole, the element-wise parts fuse into a few kernels, in
the forward, its recompute and the backward. The projections (NF4 with LoRA) stay outside: bitsandbytes' kernels
are not traced.
The math is transformers' (`Qwen3_5GatedDeltaNet.forward` without a cache, and `Qwen3_5RMSNormGated`), with the
documents kept apart as `slimtune.train.step.linear_attention` explains.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from slimtune.train.step.delta_rule import chunk_gated_delta_rule

# The log-decay at a document's first token: the state carried in is scaled by e^-30 (~1e-13). Larger magnitudes
# cost precision in the kernels' running sums of g within a chunk (fp32: ~1e-7 of the sum's magnitude).
RESET = -30.0


def gated_delta_mixer(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    positions: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    key_dim: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float,
    rule: Callable[..., torch.Tensor] = chunk_gated_delta_rule,
) -> torch.Tensor:
    """The mixer's output before `out_proj`, (rows, length, value_dim), from its projections of the hidden states
    (`qkv`, `z`, `b`, `a`: (rows, length, width)) and `positions` (rows, length; 0 at each document's start)."""
    rows, length, _ = qkv.shape
    mixed = act(_conv_within_documents(qkv, conv_weight, conv_bias, positions)).to(qkv.dtype)
    query, key, value = torch.split(mixed, [key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    query = query.reshape(rows, length, -1, head_k_dim)
    key = key.reshape(rows, length, -1, head_k_dim)
    value = value.reshape(rows, length, -1, head_v_dim)
    share = value.shape[2] // key.shape[2]
    if share > 1:  # each query/key head serves that many value heads: the rules take them repeated
        # (transformers >= 5.23's would repeat them itself; repeated ones pass through it unchanged)
        query = query.repeat_interleave(share, dim=2)
        key = key.repeat_interleave(share, dim=2)
    beta = b.sigmoid()
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    g = g.masked_fill((positions == 0).unsqueeze(-1), RESET)
    out = rule(query, key, value, g, beta).reshape(-1, head_v_dim)
    return _gated_norm(out, z.reshape(-1, head_v_dim), norm_weight, eps).reshape(rows, length, -1)


@functools.cache
def compiled_gated_delta_mixer() -> Callable[..., torch.Tensor]:
    """`gated_delta_mixer` through torch.compile: one compiled function per process, shared by every layer (the
    layers differ only in their tensors); the first call of each shape compiles (tens of seconds)."""
    return torch.compile(gated_delta_mixer)


def _conv_within_documents(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor
) -> torch.Tensor:
    """The depthwise causal conv (`weight`: (channels, 1, taps)) over `x` (rows, length, channels), each tap
    reaching no further back than the token's document start; in the weight's dtype, as transformers computes it."""
    weight = weight.squeeze(1)  # (channels, taps): the last tap multiplies the token itself
    taps = weight.shape[1]
    x = x.to(weight.dtype)
    out = x * weight[:, -1]
    for back in range(1, taps):
        earlier = torch.nn.functional.pad(x[:, :-back], (0, 0, back, 0))
        reach = (positions >= back).unsqueeze(-1).to(x.dtype)  # that token is in this token's document
        out = out + earlier * reach * weight[:, -1 - back]
    return out if bias is None else out + bias


def _gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `Qwen3_5RMSNormGated`: RMS-normalize in fp32, scale in the input's dtype, gate by silu(gate)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = weight * x.to(dtype)
    return (x * torch.nn.functional.silu(gate.float())).to(dtype)
