"""Packed rows through linear-attention (recurrent) layers: each document runs through the mixer on its own.

Qwen3.5's Gated DeltaNet carries state along the row: a causal conv1d over the last `linear_conv_kernel_dim`
tokens and the delta rule's recurrent state. transformers' torch path (`causal_conv1d_fn`,
`torch_chunk_gated_delta_rule`) takes no document boundaries (it drops `cu_seqlens`), so on a packed row
(position ids restarting per document, no mask) each document would start from the previous one's state:
tests/test_family_qwen35.py measures the leak. Full-attention layers are already kept apart by transformers'
block mask from the same position ids.

`isolate_documents` records each forward's document boundaries (where the position ids restart at 0) from the
text model's inputs, and gives every Gated DeltaNet an instance forward that runs its mixer once per document,
so the conv and the recurrence start from zero at each one, as for the document alone. The decoder layer is
still called once (its norms and MLP batched, checkpointing's per-layer bookkeeping unchanged); a recompute in
backward reads the boundaries of the forward it repeats. Padded batches (a mask) and generation (a cache) go
through the original forward.

On a GPU with flash-linear-attention installed (`pip install 'slimtune[fla]'`, the GPU lock has it), the batch
runs as one sequence of documents instead: its Triton causal conv1d and chunked gated delta rule take the
documents' offsets (`cu_seqlens`) and restart the conv and the state at each, in one launch each, where the
loop above makes ~6 launches per document. The boundaries are read on the host, so CUDA graphs are refused for
these models (`slimtune.train.step.checkpointing.graphs_refusal`): a replay would keep the captured batch's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimtune.kernels.instance_patch import KernelPatch, replace_forward

_MARK = "_slimtune_documents"


@dataclass
class _Documents:
    """Per row, the token offsets where documents start (then the row length), of the forward in progress."""

    bounds: list[list[int]] | None = None


def isolate_documents(model: torch.nn.Module) -> KernelPatch:
    """Run `model`'s Gated DeltaNet mixers one document at a time on packed rows (idempotent); undo restores."""
    patch = KernelPatch()
    if "linear_attention" not in (getattr(model.config, "layer_types", None) or ()):
        return patch  # no recurrent layer: nothing to keep apart, nothing to import
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5TextModel

    for text_model in [m for m in model.modules() if isinstance(m, Qwen3_5TextModel)]:
        if getattr(text_model, _MARK, False):
            continue
        documents = _Documents()
        hook = text_model.register_forward_pre_hook(functools.partial(_record, documents), with_kwargs=True)
        patch.on_undo(hook.remove)
        for mixer in [m for m in text_model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]:
            replace_forward(mixer, _per_document, patch, documents=documents)
        setattr(text_model, _MARK, True)
        patch.on_undo(lambda text_model=text_model: delattr(text_model, _MARK))
    return patch


def _record(documents: _Documents, _module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and position_ids.ndim == 3:  # (4, B, T): text positions first
        position_ids = position_ids[0]
    if position_ids is None or not bool((position_ids[:, 1:] == 0).any()):
        documents.bounds = None
        return
    length = position_ids.shape[1]
    starts = [(torch.nonzero(row[1:] == 0).flatten() + 1).tolist() for row in position_ids]
    documents.bounds = [[0, *s, length] for s in starts]


def _per_document(
    mixer: torch.nn.Module,
    original,
    hidden_states: torch.Tensor,
    cache_params=None,
    attention_mask: torch.Tensor | None = None,
    documents: _Documents | None = None,
    **kwargs,
) -> torch.Tensor:
    bounds = documents.bounds if documents is not None else None
    if bounds is None or cache_params is not None or attention_mask is not None or len(bounds) != len(hidden_states):
        return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    kernels = _fla_kernels() if hidden_states.is_cuda else None
    if kernels is not None:
        return _varlen(mixer, hidden_states, bounds, *kernels)
    rows = [
        torch.cat([original(hidden_states[b : b + 1, s:e], **kwargs) for s, e in zip(row[:-1], row[1:])], dim=1)
        for b, row in enumerate(bounds)
    ]
    return torch.cat(rows, dim=0)


@functools.cache
def _fla_kernels() -> tuple[Callable, Callable] | None:
    """flash-linear-attention's varlen causal conv1d and chunked gated delta rule, or None where not installed."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return causal_conv1d, chunk_gated_delta_rule


def _varlen(
    mixer: torch.nn.Module, hidden_states: torch.Tensor, bounds: list[list[int]], conv: Callable, delta_rule: Callable
) -> torch.Tensor:
    """`mixer`'s forward (transformers' Qwen3_5GatedDeltaNet without a cache or mask) over the batch's rows as one
    sequence of documents: the conv and the delta rule restart at each document start (`bounds`, per row)."""
    rows, length, _ = hidden_states.shape
    starts = [b * length + s for b, row in enumerate(bounds) for s in row[:-1]]
    cu_cpu = torch.tensor([*starts, rows * length], dtype=torch.long)
    cu = cu_cpu.to(hidden_states.device, non_blocking=True)
    x = hidden_states.reshape(1, rows * length, -1)
    mixed, _ = conv(
        mixer.in_proj_qkv(x),
        weight=mixer.conv1d.weight.squeeze(1),
        bias=mixer.conv1d.bias,
        activation=mixer.activation,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(1, rows * length, -1, mixer.head_k_dim)
    key = key.reshape(1, rows * length, -1, mixer.head_k_dim)
    value = value.reshape(1, rows * length, -1, mixer.head_v_dim)
    beta = mixer.in_proj_b(x).sigmoid()
    g = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(x).float() + mixer.dt_bias)
    out, _ = delta_rule(
        query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu
    )
    z = mixer.in_proj_z(x).reshape(-1, mixer.head_v_dim)
    out = mixer.norm(out.reshape(-1, mixer.head_v_dim), z).reshape(rows, length, -1)
    return mixer.out_proj(out)
