"""Which models' decoder layers a CUDA graph replay cannot reproduce, read from the config alone: the planner
(`slimtune.plan.train_settings`) reserves no graph pool for them and the runtime
(`slimtune.train.step.checkpointing.graphs_refusal`) leaves their backward eager, for one reason stated here."""

from __future__ import annotations

from typing import Any

from slimtune.models.experts import expert_count
from slimtune.models.families import text_fields

KV_SHARING = "the layers hand key/value states to later ones in a shared dict (Gemma 4); a replay would not fill it"
LINEAR_ATTENTION = (
    "the linear-attention layers read each batch's document starts outside their arguments; a replay would not"
)
EXPERTS = "the host picks which experts to run from each batch's routing (mixture of experts); a replay would not"


def replay_refusal(config: dict[str, Any]) -> str | None:
    """Why no decoder layer of a model with this config.json (or `PretrainedConfig.to_dict()`) can be replayed from
    a CUDA graph, or None."""
    text = text_fields(config)
    if "num_kv_shared_layers" in text or text.get("model_type") == "gemma4_text":
        return KV_SHARING
    if text.get("model_type") == "qwen3_5_text" or "linear_attention" in (text.get("layer_types") or ()):
        return LINEAR_ATTENTION
    if expert_count(text):
        return EXPERTS
    return None
