"""Packed rows through PyTorch's variable-length flash attention, with no T x T mask.

With SDPA, transformers keeps packed examples apart by building a dense block-diagonal mask from the
position ids (B x 1 x T x T, once per forward), and a masked SDPA call leaves the flash backend for the
memory-efficient one. PyTorch's flash kernel takes variable-length rows: the micro-batch is flattened to
one row, example boundaries go in as `cu_seq_lens` (the collator's `flash_varlen` batches), and each
example attends to itself only.

The kernel is called as aten's `_flash_attention_forward`, whose backward aten registers, not through
`torch.nn.attention.varlen.varlen_attn` (torch >= 2.9): that wraps the same kernel in a Python custom op
with a Python autograd step and an extra launch per call, and in torch 2.11 it has no grouped-query
attention, so k and v had to be repeated to every query head (and their gradients summed back). The aten
kernel takes fewer k/v heads as they are. On a 1B step, which the host bounds, the hand loop on packed
rows through `varlen_attn` took 1.06-1.13x its step on plain rows through SDPA (benchmarks/product_gap.py).

This registers that kernel with transformers' `AttentionInterface` under `VARLEN` (the documented way to
add an attention function; nothing of transformers is patched). A name transformers has no mask function
for gets `attention_mask=None` (masking_utils: "custom attention without equivalent mask creation"), so
the model must only be switched while it trains on packed or padding-free batches: `prefer_varlen`
does that, and the boundaries come from `cu_seq_lens_q` or, failing that, from restarting position ids.
Sliding-window layers (Gemma 3, Qwen2, Mistral, Phi-3) pass their window, which the kernel takes as its left
bound, so they stay on it too (with a dense mask they left flash: Gemma-3-1B trained at 0.48x Unsloth's speed).
Off CUDA (tests) each example goes through its own causal SDPA call: slow, same result.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from slimtune.models.families import FAMILIES, text_fields

log = logging.getLogger(__name__)

VARLEN = "slimtune_varlen"


@functools.cache
def _flash_varlen() -> Callable[..., Any] | None:
    """aten's flash-attention forward (variable-length rows, autograd included), or None where torch lacks it."""
    return getattr(torch.ops.aten, "_flash_attention_forward", None)


def _boundaries(kwargs: dict, position_ids: torch.Tensor | None, total: int, device: torch.device):
    """(cu_seq_lens as int32 on `device`, longest example) of the flattened tokens."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu.to(device=device, dtype=torch.int32), int(kwargs["max_length_q"])
    if position_ids is None:
        raise ValueError(
            f"attention {VARLEN!r} needs example boundaries: pass cu_seq_lens_q/max_length_q (RowCollator with "
            "flash_varlen=True) or restarting position_ids"
        )
    starts = torch.nonzero(position_ids.reshape(-1) == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([total])]).to(device=device, dtype=torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, T, D) in, (B, T, H, D) out, causal within each example."""
    batch, heads, length, dim = query.shape
    total = batch * length
    cu, longest = _boundaries(kwargs, kwargs.get("position_ids"), total, query.device)
    # A sliding-window layer attends to its last `window` tokens, itself included (transformers' overlay:
    # kv > q - window); flash's inclusive left bound is window - 1. Layers pass it as `sliding_window`.
    window = kwargs.get("sliding_window")
    # (B, H, T, D) -> (B*T, H, D): a transpose view; the kernel takes any strides but the last.
    q, k, v = (t.transpose(1, 2).reshape(total, t.shape[1], dim) for t in (query, key, value))
    flash = _flash_varlen() if query.is_cuda and dropout == 0.0 else None
    if flash is not None and query.dtype in (torch.float16, torch.bfloat16):
        # causal, no dropout, no debug mask; k and v keep their own (fewer) heads
        bounds = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
        out = flash(q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scaling, **bounds)[0]
    else:
        out = torch.empty_like(q)
        ends = cu.tolist()
        for start, end in zip(ends[:-1], ends[1:], strict=True):
            if start == end:  # an empty segment the collator padded the boundaries with
                continue
            seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(
                *seg,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=k.shape[1] != heads,
                **_causal(end - start, window, q.device),
            ).transpose(0, 1)
    return out.reshape(batch, length, heads, dim), None


def _causal(length: int, window: int | None, device: torch.device) -> dict[str, Any]:
    """SDPA's arguments for causal attention over `length` tokens, within the last `window` where given."""
    if not window or window >= length:
        return {"is_causal": True}
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return {"attn_mask": (distance >= 0) & (distance < window)}


def register() -> None:
    """Make `VARLEN` a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


def _config_reason(get: Callable[[str], Any]) -> str | None:
    """Why a decoder whose config fields `get` returns cannot use `VARLEN`, else None."""
    types = set(get("layer_types") or ())
    if types - {"full_attention", "sliding_attention"}:
        return f"layers of type {', '.join(sorted(types - {'full_attention', 'sliding_attention'}))}"
    family = FAMILIES.get(get("model_type"))
    sliding = "sliding_attention" in types or get("sliding_window")
    if sliding and not (family and family.sliding_window_kwarg):
        return "sliding-window layers whose attention does not pass its window on"
    if family and family.attention_sinks:
        return "learned attention sinks, which varlen attention does not add"
    if get("attn_logit_softcapping") or (get("head_dim") or 0) > 256:
        return "logit soft-capping or head_dim over 256"
    return None


def varlen_supported(model: torch.nn.Module, device: torch.device) -> str | None:
    """None when `model` can train packed rows through `VARLEN` on `device`; else the reason it cannot."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention is {getattr(config, '_attn_implementation', None)!r}, not sdpa"
    if device.type != "cuda" or _flash_varlen() is None:
        return "needs CUDA and aten's flash attention"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "flash attention needs compute capability 8.0 or newer"
    return _config_reason(lambda field: getattr(config, field, None))


def varlen_expected(config: dict[str, Any], device_type: str, packing: str) -> bool:
    """Whether training a model of config.json `config` will use `VARLEN` (before it is loaded): what the
    memory estimates assume. The compute capability is not known then; an older GPU's estimate counts
    varlen's q, k and v all the same, on the safe side."""
    if device_type != "cuda" or packing == "padded" or _flash_varlen() is None:
        return False
    return _config_reason(text_fields(config).get) is None


def prefer_varlen(model: torch.nn.Module, device: torch.device) -> bool:
    """Switch a model that trains packed rows from SDPA to `VARLEN` where it can; True when it uses `VARLEN`.

    Called only for packed / padding-free batching: the switch drops transformers' mask building, which
    padded batches need.
    """
    if getattr(model.config, "_attn_implementation", None) == VARLEN:
        return True
    reason = varlen_supported(model, device)
    if reason is not None:
        log.info("packed rows stay on sdpa with a block mask: %s", reason)
        return False
    register()
    model.set_attn_implementation(VARLEN)
    log.info("packed rows go through torch varlen flash attention (%s)", VARLEN)
    return True
