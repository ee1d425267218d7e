"""Packed rows through a model that builds its attention masks without the position ids: gpt-oss.

transformers 5.23 keeps packed documents apart by building a block-diagonal mask from `position_ids` (where they
restart at 0), but only where the model hands them to `create_causal_mask`. `GptOssModel.forward` does not (its
`mask_kwargs` have no position_ids), so on a packed row its attention layers see every earlier document: measured
on the tiny gpt_oss (one sliding and one full-attention layer, 12 examples in packed rows of 128), a packed loss of
6.8346 against 6.8397 for the examples alone (tests/test_family_gpt_oss.py).

`mask_documents` gives such a model's text model a forward pre-hook that builds both masks itself, with the position
ids, and passes them in as the prepared mapping `forward` accepts in `attention_mask` (a dict per layer type, as
`generate` passes it); the embeddings are looked up first so the masks take their dtype. Inputs with a mask or a
cache go through unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from slimtune.kernels.instance_patch import KernelPatch

# transformers text models whose forward builds its masks without position_ids (checked in transformers 5.23)
WITHOUT_POSITION_MASKS = ("GptOssModel",)
_MARK = "_slimtune_document_masks"


def mask_documents(model: torch.nn.Module) -> KernelPatch:
    """Give `model`'s text models in `WITHOUT_POSITION_MASKS` masks that keep packed documents apart (idempotent)."""
    patch = KernelPatch()
    for text_model in [m for m in model.modules() if type(m).__name__ in WITHOUT_POSITION_MASKS]:
        if getattr(text_model, _MARK, False):
            continue
        hook = text_model.register_forward_pre_hook(functools.partial(_with_masks, text_model), with_kwargs=True)
        patch.on_undo(hook.remove)
        setattr(text_model, _MARK, True)
        patch.on_undo(lambda text_model=text_model: delattr(text_model, _MARK))
    return patch


def _with_masks(
    text_model: torch.nn.Module, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    position_ids = kwargs.get("position_ids")
    if position_ids is None or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
        return None
    if args:  # input_ids passed by position: the keyword form below replaces it
        kwargs["input_ids"], args = args[0], args[1:]
    if kwargs.get("inputs_embeds") is None:
        kwargs["inputs_embeds"] = text_model.embed_tokens(kwargs.pop("input_ids"))
    mask_kwargs = {
        "config": text_model.config,
        "inputs_embeds": kwargs["inputs_embeds"],
        "attention_mask": None,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    kwargs["attention_mask"] = {
        "full_attention": create_causal_mask(**mask_kwargs),
        "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
    }
    return args, kwargs
