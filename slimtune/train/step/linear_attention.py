"""Packed rows through linear-attention (recurrent) layers: every document starts from a fresh state.

Qwen3.5's Gated DeltaNet carries state along the row: a causal conv1d over the last `linear_conv_kernel_dim`
tokens and the delta rule's recurrent state. transformers' forward takes no document boundaries (its torch path
drops `cu_seqlens`), so on a packed row (position ids restarting per document, no mask) each document would start
from the previous one's state: tests/test_family_qwen35.py measures the leak. Full-attention layers are already
kept apart by transformers' block mask from the same position ids.

`isolate_documents` keeps each forward's position ids (the text model's input) and gives every Gated DeltaNet an
instance forward that runs the whole batch in one call, as transformers does, with the documents kept apart:
- the conv sums its taps itself, each tap masked where it would reach before the token's document start (a
  position below the tap's offset), so a document's first tokens see zeros, as at the start of a row;
- at each document's first token the log-decay `g` is set to `deltanet_mixer.RESET`: the gated delta rule
  scales the state it carries in by exp(g) before adding the token's update, so the previous document's state
  enters as e^-30 (~1e-13) of itself. That is the reset of a fresh document, up to rounding, and it needs no
  document offsets: the chunked kernel (ours, `delta_rule`, or flash-linear-attention's Triton kernel where
  installed) runs unchanged, one launch sequence per layer however many documents a row holds.
The mixer's math between its projections is `slimtune.train.step.deltanet_mixer`'s, compiled whole on a GPU.
The decoder layer is called once (its norms and MLP batched, checkpointing's per-layer bookkeeping unchanged); a
recompute in backward reads the position ids of the forward it repeats. Padded batches (a mask) and generation
(a cache) go through the original forward. The position ids live outside the layers' arguments, so CUDA graphs
are refused for these models (`slimtune.train.step.checkpointing.graphs_refusal`): a replay would read the
captured batch's.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimtune.kernels.instance_patch import KernelPatch, replace_forward
from slimtune.train.step.deltanet_mixer import compiled_gated_delta_mixer, gated_delta_mixer

_MARK = "_slimtune_documents"


@dataclass
class _Documents:
    """The (rows, length) position ids of the packed forward in progress (restarting at 0 per document), or None."""

    positions: torch.Tensor | None = None


def isolate_documents(model: torch.nn.Module) -> KernelPatch:
    """Keep the documents of packed rows apart in `model`'s Gated DeltaNet mixers (idempotent); undo restores."""
    patch = KernelPatch()
    if "linear_attention" not in (getattr(model.config, "layer_types", None) or ()):
        return patch  # no recurrent layer: nothing to keep apart, nothing to import
    from transformers.activations import ACT2FN
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5TextModel

    for text_model in [m for m in model.modules() if isinstance(m, Qwen3_5TextModel)]:
        if getattr(text_model, _MARK, False):
            continue
        documents = _Documents()
        hook = text_model.register_forward_pre_hook(functools.partial(_record, documents), with_kwargs=True)
        patch.on_undo(hook.remove)
        acts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # one per name: the compiled mixer sees
        # the same function in every layer
        for mixer in [m for m in text_model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]:
            act = acts.setdefault(mixer.activation, ACT2FN[mixer.activation])
            replace_forward(mixer, _packed, patch, documents=documents, math=_mixer(mixer.A_log.device), act=act)
        setattr(text_model, _MARK, True)
        patch.on_undo(lambda text_model=text_model: delattr(text_model, _MARK))
    return patch


def _mixer(device: torch.device) -> Callable[..., torch.Tensor]:
    """The mixer between its projections: with flash-linear-attention's chunked kernel (through transformers) where
    it is installed, else with ours, the whole compiled on a GPU (`slimtune.train.step.deltanet_mixer`)."""
    if importlib.util.find_spec("fla") is None:
        return compiled_gated_delta_mixer() if device.type == "cuda" else gated_delta_mixer
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    def fla(query, key, value, g, beta):
        out, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        return out

    return functools.partial(gated_delta_mixer, rule=fla)


def _record(documents: _Documents, _module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and position_ids.ndim == 3:  # (4, B, T): text positions first
        position_ids = position_ids[0]
    packed = position_ids is not None and bool((position_ids[:, 1:] == 0).any())
    documents.positions = position_ids if packed else None


def _packed(
    mixer: torch.nn.Module,
    original,
    hidden_states: torch.Tensor,
    cache_params=None,
    attention_mask: torch.Tensor | None = None,
    documents: _Documents | None = None,
    math: Callable[..., torch.Tensor] | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    positions = documents.positions if documents is not None else None
    if positions is None or cache_params is not None or attention_mask is not None:
        return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    if positions.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"position ids of shape {tuple(positions.shape)} for hidden states {tuple(hidden_states.shape)}"
        )
    out = math(
        mixer.in_proj_qkv(hidden_states),
        mixer.in_proj_z(hidden_states),
        mixer.in_proj_b(hidden_states),
        mixer.in_proj_a(hidden_states),
        positions,
        mixer.conv1d.weight,
        mixer.conv1d.bias,
        mixer.A_log,
        mixer.dt_bias,
        mixer.norm.weight,
        act,
        mixer.key_dim,
        mixer.head_k_dim,
        mixer.head_v_dim,
        mixer.norm.variance_epsilon,
    )
    return mixer.out_proj(out)
