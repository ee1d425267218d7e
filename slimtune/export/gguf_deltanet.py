"""Gated DeltaNet (Qwen3.5 linear attention) tensors in the layout llama.cpp's qwen35 reads.

Read in llama.cpp's converter (`conversion/qwen.py`, Qwen3NextModel and _LinearAttentionVReorderBase) and
loader (`src/models/qwen35.cpp`) as vendored by llama-cpp-python 0.3.36; checked by converting the tiny
model and comparing llama.cpp's logits with transformers' (tests/test_family_qwen35.py):
- `A_log` is stored as A = -exp(A_log) under the bare name `ssm_a` (no `.weight`);
- `dt_bias` is the bias of `ssm_dt`;
- `conv1d`'s (channels, 1, kernel) weight loses its middle axis (`ssm_conv1d`, which the converter keeps f32);
- the gated output norm (`linear_attn.norm`) multiplies by w, not by (1 + w) as Qwen3.5's other norms: no
  offset;
- value heads: transformers groups them by key head ([k0: v0 v1][k1: v0 v1]); ggml broadcasts the key heads
  tiled ([k0 v0, k1 v0, k0 v1, k1 v1]), so every value-head axis is reordered where there are more value
  heads than key heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DeltaNetTensor:
    """How one `linear_attn.*` tensor goes to GGUF."""

    key: str  # the Hugging Face name gguf's tables map (dt_bias is looked up as dt_proj.bias)
    bare: bool  # llama.cpp names it without `.weight`
    shape: tuple[int, ...]  # the shape written (conv1d: squeezed)
    transform: Callable[[np.ndarray], np.ndarray]


def deltanet_tensor(key: str, shape: tuple[int, ...], config: dict[str, Any]) -> DeltaNetTensor:
    """The GGUF layout of the `linear_attn.*` tensor `key` of shape `shape` (config.json `config`)."""
    k_heads, v_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    v_head_dim = int(config["linear_value_head_dim"])
    qk_rows = 2 * int(config["linear_key_head_dim"]) * k_heads

    def tiled(w: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        if v_heads == k_heads:
            return w
        w = np.moveaxis(w, axis, 0)
        grouped = w.reshape(k_heads, v_heads // k_heads, head_dim, *w.shape[1:])
        return np.moveaxis(grouped.swapaxes(0, 1).reshape(w.shape), 0, axis)

    def v_rows_tiled(w: np.ndarray) -> np.ndarray:  # q and k rows stay, the value rows are reordered
        return np.concatenate([w[:qk_rows], tiled(w[qk_rows:], 0, v_head_dim)])

    suffix = key.rsplit(".linear_attn.", 1)[1]
    same = DeltaNetTensor(key, False, shape, lambda w: w)
    layouts = {
        "in_proj_qkv.weight": DeltaNetTensor(key, False, shape, v_rows_tiled),
        "in_proj_z.weight": DeltaNetTensor(key, False, shape, lambda w: tiled(w, 0, v_head_dim)),
        "in_proj_a.weight": DeltaNetTensor(key, False, shape, lambda w: tiled(w, 0, 1)),
        "in_proj_b.weight": DeltaNetTensor(key, False, shape, lambda w: tiled(w, 0, 1)),
        "out_proj.weight": DeltaNetTensor(key, False, shape, lambda w: tiled(w, 1, v_head_dim)),
        "A_log": DeltaNetTensor(key, True, shape, lambda w: -np.exp(tiled(w, 0, 1))),
        "dt_bias": DeltaNetTensor(key.replace(".dt_bias", ".dt_proj.bias"), False, shape, lambda w: tiled(w, 0, 1)),
        "conv1d.weight": DeltaNetTensor(
            key, False, (shape[0], shape[-1]), lambda w: v_rows_tiled(w.reshape(w.shape[0], w.shape[-1]))
        ),
        "norm.weight": same,
    }
    if suffix not in layouts:
        raise ValueError(f"tensor {key!r}: a Gated DeltaNet tensor the converter does not know")
    return layouts[suffix]
