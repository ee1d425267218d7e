"""Multimodal checkpoints whose language model is a supported text family: slimtune fine-tunes that model on text.

The vision tower is not loaded at all (text data never reaches it): on text-only input, Gemma 3's
`Gemma3ForConditionalGeneration`, Mistral 3's `Mistral3ForConditionalGeneration`, Gemma 4's
`Gemma4ForConditionalGeneration` and Qwen3.5's `Qwen3_5ForConditionalGeneration` compute exactly what their
language model alone (`Gemma3ForCausalLM` / `MistralForCausalLM` / `Gemma4ForCausalLM` / `Qwen3_5ForCausalLM` on
the `text_config`) computes (the tiny models: logits equal to the bit), so loading the language model alone is
correct and spares the tower's memory (SigLIP in Gemma-3-4B: 0.42 B parameters by its vision_config, 0.8 GB in
bf16). LoRA, training and GGUF then see a plain text family; only the checkpoint keys differ, and this module maps
them both ways so that the merge writes the checkpoint's own key names and copies the other weights (vision and
audio towers, projectors, Qwen3.5's multi-token prediction) through untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Layout:
    """A multimodal checkpoint slimtune trains the language model of."""

    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"[0]
    text_model_type: str  # its text_config's "model_type": a row of slimtune.models.families
    # the tiny checkpoint's config beside its text_config (slimtune.models.tiny.save_tiny_multimodal)
    tiny: dict[str, Any]


LAYOUTS: dict[str, Layout] = {
    layout.model_type: layout
    for layout in (
        Layout(
            "gemma3",
            "Gemma3ForConditionalGeneration",
            "gemma3_text",
            # SigLIP with one layer; 28 / 14 = 2x2 patches pooled to mm_tokens_per_image = 4 soft tokens
            tiny={
                "vision_config": {
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "image_size": 28,
                    "patch_size": 14,
                },
                "mm_tokens_per_image": 4,
            },
        ),
        Layout(
            "mistral3",
            "Mistral3ForConditionalGeneration",
            "mistral",
            # Pixtral with one layer; 28 / 14 = 2x2 patches merged (spatial_merge_size 2) into 1 token
            tiny={
                "vision_config": {
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "head_dim": 16,
                    "image_size": 28,
                    "patch_size": 14,
                },
                "spatial_merge_size": 2,
            },
        ),
        Layout(
            "gemma4",
            "Gemma4ForConditionalGeneration",
            "gemma4_text",
            # its vision encoder with one layer; `embed_vision` projects the pooled patches into the text space
            tiny={
                "vision_config": {
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 2,
                    "head_dim": 16,
                    "patch_size": 14,
                    "pooling_kernel_size": 2,
                    "position_embedding_size": 64,
                }
            },
        ),
        Layout(
            "qwen3_5",
            "Qwen3_5ForConditionalGeneration",
            "qwen3_5_text",
            # the released Qwen3.5 checkpoints: a ViT with one layer here; 2 x 2 patches merged into one token
            tiny={
                "vision_config": {
                    "depth": 1,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_heads": 2,
                    "patch_size": 14,
                    "spatial_merge_size": 2,
                    "num_position_embeddings": 16,
                    "out_hidden_size": 256,  # the tiny language model's hidden size
                }
            },
        ),
    )
}

# Where checkpoints keep the language model, as (checkpoint prefix, the text model's own prefix): the layout the
# Hub's checkpoints have and transformers 5 still writes (`language_model.model.`), and transformers 5's
# in-memory one (`model.language_model.`); every other key (vision tower, projector) is not the text model's.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
# The layouts' weights outside the language model, by key prefix in either layout: Gemma 3's and Mistral 3's tower
# and projector, Gemma 4's towers and their embedders (the audio one in E2B/E4B), Qwen3.5's tower with its merger
# (model.visual) and its multi-token prediction
_COPIED_PARTS = {
    "vision_tower.": "vision tower",
    "multi_modal_projector.": "vision tower",
    "model.vision_tower.": "vision tower",
    "model.multi_modal_projector.": "vision tower",
    "model.embed_vision.": "vision tower",
    "model.audio_tower.": "audio tower",
    "model.embed_audio.": "audio tower",
    "model.visual.": "vision tower",
    "mtp.": "mtp",
}
# transformers' `key_mapping` (regex on checkpoint keys) that loads the text model alone from such a checkpoint
KEY_MAPPING: dict[str, str] = {f"^{re.escape(ours)}": text for ours, text in _TEXT_PREFIXES if ours != text}


def layout_of(config: dict[str, Any]) -> Layout | None:
    """The multimodal layout of a config.json dict, None for a text model or an unsupported type."""
    return LAYOUTS.get(str(config.get("model_type")))


def layout_problem(config: dict[str, Any]) -> str | None:
    """Why slimtune cannot train this multimodal checkpoint's language model (one line), or None."""
    model_type = config["model_type"]
    if config.get("quantization_config"):  # its language model would load without it: 16-bit shapes, packed bytes
        return (
            f"model.name_or_path: a pre-quantized {model_type} multimodal checkpoint is not supported; use its 16-bit "
            "checkpoint (slimtune quantizes the language model to NF4 itself)"
        )
    return None


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's whole config as a text checkpoint's config.json would hold it.

    transformers fills what `text_config` leaves at its defaults (the Hub's Gemma-3-4B config lists 6 of its
    text fields), and `architectures` names the text model class, so each stage reads a plain text config.
    """
    from transformers import AutoConfig

    text = AutoConfig.for_model(**config).get_text_config().to_dict()
    return {**text, "architectures": [_text_architecture(LAYOUTS[config["model_type"]])]}


def text_model_load_kwargs(model_dir: Path) -> dict[str, Any]:
    """`from_pretrained` arguments that load a multimodal checkpoint's language model alone; {} for a text model.

    transformers then skips the vision tower's and projector's keys (reported as unexpected) without reading them.
    """
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if layout_of(config) is None:
        return {}
    from transformers import AutoConfig

    return {"config": AutoConfig.for_model(**config).get_text_config(), "key_mapping": KEY_MAPPING}


def trained_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the model slimtune loads and trains: a multimodal checkpoint's language model, else `config`."""
    return text_model_config(config) if layout_of(config) else config


def copied_keys(config: dict[str, Any], keys: Iterable[str]) -> list[str]:
    """The checkpoint keys among `keys` that a merge copies as stored: every weight outside a multimodal checkpoint's
    language model (vision tower, projector, Qwen3.5's multi-token prediction `mtp.*`, which no transformers class
    loads); none for a text model. The merge copies these, `plan` counts their bytes and load_4bit names them."""
    return [] if layout_of(config) is None else [key for key in keys if text_key(key) is None]


def copied_bytes(config: dict[str, Any], tensor_bytes: dict[str, int]) -> int:
    """Bytes of the weights a merge copies as stored, from the checkpoint's tensors (name -> stored bytes): 0 for
    a text model; ~10% of Gemma-3-4B (its vision tower), and Qwen3.5's `mtp.*` besides."""
    return sum(tensor_bytes[key] for key in copied_keys(config, tensor_bytes))


def copied_part(key: str) -> str | None:
    """The known part of a multimodal checkpoint that copied `key` belongs to ("vision tower", its projector
    included; "mtp"), None for any other key (load_4bit reports those as unexpected)."""
    return next((part for prefix, part in _COPIED_PARTS.items() if key.startswith(prefix)), None)


def _text_architecture(layout: Layout) -> str:
    from slimtune.models.families import FAMILIES

    return FAMILIES[layout.text_model_type].architecture


def text_key(key: str) -> str | None:
    """The text model's name for checkpoint key `key`, or None for a vision or projector weight."""
    for ours, text in _TEXT_PREFIXES:
        if key.startswith(ours):
            return text + key.removeprefix(ours)
    return None


def checkpoint_names(keys: Iterable[str]) -> dict[str, str]:
    """Text model name -> checkpoint key, for the language-model keys among `keys`."""
    return {text: key for key in keys if (text := text_key(key)) is not None}
