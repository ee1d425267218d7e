"""What each family's config.json means beyond the family table: the extra GGUF keys llama.cpp reads, the configs
it cannot reproduce, and the per-layer shapes (sliding windows, Gemma 4's wider global heads) they share with the
memory estimates.

`slimtune.models.families` names these functions in each row (`gguf_hparams`, `check_config`). What llama.cpp needs was
read in llama.cpp's model loaders as vendored by llama-cpp-python 0.3.36 (`src/models/<arch>.cpp`) and checked by
converting each tiny model and comparing llama.cpp's logits with transformers' (tests/test_gguf_quant_verify.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf

from slimtune.models.experts import expert_count


def _layer_types(config: dict[str, Any], default: Callable[[int], bool]) -> list[bool]:
    """Per layer, True where attention is sliding-window (transformers 5 `layer_types`, else the pattern)."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    return [default(i) for i in range(n)]


def gemma2_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's logit soft-capping and sliding window, which llama.cpp reads from GGUF keys, not the config."""
    attn, final = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
    return {
        gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING: None if attn is None else float(attn),
        gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING: None if final is None else float(final),
        gguf.Keys.Attention.SLIDING_WINDOW: config["sliding_window"],
        # llama.cpp's default Gemma 2 pattern is every other layer; the exact per-layer list is written
        gguf.Keys.Attention.SLIDING_WINDOW_PATTERN: _layer_types(config, lambda i: (i + 1) % 2 == 1),
    }


def gemma3_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's sliding window, its per-layer pattern and the local layers' own RoPE base."""
    pattern = config.get("sliding_window_pattern", 6)
    out = {
        gguf.Keys.Attention.SLIDING_WINDOW: config["sliding_window"],
        gguf.Keys.Attention.SLIDING_WINDOW_PATTERN: _layer_types(config, lambda i: (i + 1) % pattern != 0),
        "{arch}.rope.freq_base_swa": float(_local_rope_theta(config)),
    }
    if config.get("final_logit_softcapping"):
        out[gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING] = float(config["final_logit_softcapping"])
    return out


def _local_rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    local = params.get("sliding_attention") or {}
    return float(local.get("rope_theta", config.get("rope_local_base_freq", 10000.0)))


def gemma_attention_scale(config: dict[str, Any]) -> str | None:
    """llama.cpp scales Gemma 2/3 queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B sizes),
    while transformers uses query_pre_attn_scalar: refuse a config where the two differ."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    scalar = config.get("query_pre_attn_scalar", head_dim)
    big = int(config["num_hidden_layers"]) in ((46, 62) if config["model_type"] == "gemma3_text" else (46,))
    expected = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
    if scalar != expected:
        return f"query_pre_attn_scalar {scalar} differs from the {expected} llama.cpp uses for this size"
    return None


def phi3_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's partial rotary width, its (unused) sliding window and longrope's original context."""
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    # Phi-4-mini rotates 3/4 of each head (transformers: int(head_dim * factor) rotary dims)
    rope_dims = int(factor * config["hidden_size"]) // config["num_attention_heads"]
    out: dict[str, Any] = {gguf.Keys.Rope.DIMENSION_COUNT: rope_dims}
    # llama.cpp reads Phi-3's sliding window but ignores it (its phi3 loader turns SWA off): 0 says "none"
    out[gguf.Keys.Attention.SLIDING_WINDOW] = int(config.get("sliding_window") or 0)
    orig = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if orig:
        out[gguf.Keys.Rope.SCALING_ORIG_CTX_LEN] = int(orig)
    return out


def phi3_check(config: dict[str, Any]) -> str | None:
    """Phi-3 128k / Phi-3.5 / Phi-4-mini extend context with longrope, which llama.cpp's phi3 takes as
    rope_factors_long/short tensors (one factor per rotary frequency); any other rope scaling it does not."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("longrope", "su"):
        return f"rope scaling {kind!r} is not converted for phi3 (only longrope, which llama.cpp's phi3 reads)"
    n_freq = phi3_hparams(config)[gguf.Keys.Rope.DIMENSION_COUNT] // 2
    for key in ("long_factor", "short_factor"):
        n = len(rope.get(key) or [])
        if n != n_freq:
            return f"longrope {key} has {n} values; llama.cpp needs one per rotary frequency ({n_freq})"
    return None


def granite_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers (embedding, residual, attention, logits), which llama.cpp applies from GGUF keys."""
    return {
        gguf.Keys.LLM.EMBEDDING_SCALE: float(config.get("embedding_multiplier", 1.0)),
        gguf.Keys.LLM.RESIDUAL_SCALE: float(config.get("residual_multiplier", 1.0)),
        gguf.Keys.Attention.SCALE: float(config.get("attention_multiplier", 1.0)),
        gguf.Keys.LLM.LOGIT_SCALE: float(config.get("logits_scaling", 1.0)),
    }


def granite_check(config: dict[str, Any]) -> str | None:
    """Why llama.cpp's granite cannot run `config` (a head_dim it does not derive), or None."""
    head_dim = config.get("head_dim")
    if head_dim and head_dim != config["hidden_size"] // config["num_attention_heads"]:
        return f"head_dim {head_dim} is not hidden_size / num_attention_heads, which llama.cpp's granite assumes"
    return None


def smollm3_check(config: dict[str, Any]) -> str | None:
    """llama.cpp's smollm3 hard-codes its NoPE layers (every 4th: layer i skips RoPE where (i + 1) % 4 == 0) and
    has no sliding window; refuse a config whose layers differ, which no GGUF key could tell llama.cpp."""
    n = int(config["num_hidden_layers"])
    interval = int(config.get("no_rope_layer_interval") or 4)
    uses_rope = [bool(r) for r in config.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(n)]][:n]
    if uses_rope != [(i + 1) % 4 != 0 for i in range(n)]:
        nope = [i for i, r in enumerate(uses_rope) if not r]
        return f"NoPE layers {nope} differ from every 4th layer (3, 7, ...), which llama.cpp's smollm3 hard-codes"
    # transformers' default layer_types make the NoPE layers the sliding ones
    types = config.get("layer_types") or ["full_attention" if r else "sliding_attention" for r in uses_rope]
    if config.get("use_sliding_window") and config.get("sliding_window") and "sliding_attention" in types:
        return "sliding-window layers (use_sliding_window); llama.cpp's smollm3 attends to the whole context"
    return None


def gemma4_sliding_layers(config: dict[str, Any]) -> list[bool]:
    """Per Gemma 4 layer, True where attention is sliding-window (transformers' default: five of every six)."""
    return _layer_types(config, lambda i: (i + 1) % 6 != 0)


def full_attention_head_dim(config: dict[str, Any]) -> int:
    """The head size of full-attention layers: Gemma 4's `global_head_dim` (transformers 5 saves it as the full
    layers' `per_layer_config` head_dim), else `head_dim`."""
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    if config.get("global_head_dim"):
        return int(config["global_head_dim"])
    full = [i for i, sliding in enumerate(_layer_types(config, lambda i: False)) if not sliding]
    per_layer = config.get("per_layer_config") or {}
    return next((int(per_layer[str(i)]["head_dim"]) for i in full if "head_dim" in per_layer.get(str(i), {})), head_dim)


def gemma4_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's gemma4 loader reads: full-attention head sizes in key/value_length, sliding ones in *_swa,
    the per-layer window pattern, how many trailing layers reuse earlier layers' KV, and the per-layer input width."""
    head_dim, full = int(config["head_dim"]), full_attention_head_dim(config)
    sliding = gemma4_sliding_layers(config)
    swa_rope = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    n, shared = int(config["num_hidden_layers"]), int(config.get("num_kv_shared_layers") or 0)
    wide = 2 if config.get("use_double_wide_mlp") else 1  # use_double_wide_mlp: KV-shared layers have 2x the MLP
    return {
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: [
            config["intermediate_size"] * (wide if i >= n - shared else 1) for i in range(n)
        ],
        gguf.Keys.Attention.KEY_LENGTH: full,
        gguf.Keys.Attention.VALUE_LENGTH: full,
        gguf.Keys.Attention.KEY_LENGTH_SWA: head_dim,
        gguf.Keys.Attention.VALUE_LENGTH_SWA: head_dim,
        gguf.Keys.Rope.DIMENSION_COUNT: full,  # proportional rope: the rope_freqs tensor stops the unrotated pairs
        gguf.Keys.Rope.DIMENSION_COUNT_SWA: int(head_dim * float(swa_rope.get("partial_rotary_factor", 1.0))),
        gguf.Keys.Attention.SLIDING_WINDOW: config["sliding_window"],
        gguf.Keys.Attention.SLIDING_WINDOW_PATTERN: sliding,
        gguf.Keys.Attention.SHARED_KV_LAYERS: shared,
        gguf.Keys.LLM.EMBD_LENGTH_PER_LAYER_INP: int(config.get("hidden_size_per_layer_input") or 0),
        "{arch}.rope.freq_base_swa": _local_rope_theta(config),
        # llama.cpp's gemma4 caps at 30 unless told (0 turns it off); transformers caps only where the config says
        gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING: float(config.get("final_logit_softcapping") or 0.0),
    }


def gemma4_check(config: dict[str, Any]) -> str | None:
    """What llama.cpp's gemma4 (0.3.36) cannot reproduce, or slimtune does not train."""
    if config.get("enable_moe_block"):
        return "the mixture-of-experts block (Gemma 4 26B-A4B) is not supported"
    if config.get("hidden_size_per_layer_input") and config.get("vocab_size_per_layer_input") != config["vocab_size"]:
        return "vocab_size_per_layer_input differs from vocab_size; llama.cpp reads one per-layer row per token"
    if not any(gemma4_sliding_layers(config)):  # llama.cpp aborts the process loading it (GGML_ASSERT is_swa_any)
        return "no sliding-window layer (see layer_types): llama.cpp's gemma4 needs at least one"
    shared = int(config.get("num_kv_shared_layers") or 0)
    if shared:
        # llama.cpp: a shared layer reads the last unshared global layer's KV, or the one before it for sliding
        # layers; transformers reads the last unshared layer of the same type
        sliding = gemma4_sliding_layers(config)
        first = int(config["num_hidden_layers"]) - shared
        if first < 2 or sliding[first - 1] or not sliding[first - 2]:
            return f"the last unshared layers ({first - 2}, {first - 1}) must be sliding then global for llama.cpp"
    return None


def linear_attention_layers(config: dict[str, Any]) -> list[bool]:
    """Per Qwen3.5 layer, True where it is a Gated DeltaNet (linear attention) layer: three of every four."""
    n, interval = int(config["num_hidden_layers"]), int(config.get("full_attention_interval") or 4)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
    ]
    return [t == "linear_attention" for t in types]


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def qwen35_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's qwen35 loader reads: the DeltaNet sizes as its ssm_* keys (state size = key head width,
    groups = key heads, time-step rank = value heads), the full-attention interval (llama.cpp derives the
    recurrent layers from it, so `qwen35_check` refuses layer_types that do not follow it), the partial rotary
    width and the multimodal rope sections (all equal positions for text, so any split rotates the same)."""
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    rope = _rope_parameters(config)
    factor = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    sections = list(rope.get("mrope_section") or [11, 11, 10])  # transformers' default
    return {
        gguf.Keys.SSM.CONV_KERNEL: int(config["linear_conv_kernel_dim"]),
        gguf.Keys.SSM.STATE_SIZE: int(config["linear_key_head_dim"]),
        gguf.Keys.SSM.GROUP_COUNT: int(config["linear_num_key_heads"]),
        gguf.Keys.SSM.TIME_STEP_RANK: int(config["linear_num_value_heads"]),
        gguf.Keys.SSM.INNER_SIZE: int(config["linear_value_head_dim"]) * int(config["linear_num_value_heads"]),
        gguf.Keys.LLM.FULL_ATTENTION_INTERVAL: int(config.get("full_attention_interval") or 4),
        gguf.Keys.Rope.DIMENSION_COUNT: int(head_dim * factor),
        gguf.Keys.Rope.DIMENSION_SECTIONS: sections + [0] * (4 - len(sections)),
    }


def qwen35_check(config: dict[str, Any]) -> str | None:
    """What llama.cpp's qwen35 (0.3.36) cannot reproduce: biases, value heads that do not tile the key heads,
    rope scaling, and layer types other than a full-attention layer every `full_attention_interval` layers."""
    if config.get("attention_bias"):
        return "attention_bias: llama.cpp's qwen35 has no attention biases"
    k_heads, v_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    if v_heads % k_heads:
        return f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}"
    kind = _rope_parameters(config).get("rope_type") or "default"
    if kind != "default":
        return f"rope scaling {kind!r} is not converted for qwen35"
    n, interval = int(config["num_hidden_layers"]), int(config.get("full_attention_interval") or 4)
    if linear_attention_layers(config) != [(i + 1) % interval != 0 for i in range(n)]:
        return f"layer_types differ from one full-attention layer every {interval}, which llama.cpp's qwen35 reads"
    return None


def qwen3_moe_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """The expert counts and width llama.cpp's qwen3moe reads (what llama.cpp's converter writes for Qwen3MoeModel).
    Its router is fixed in llama.cpp's graph (softmax, then the top-k weights renormalized; no shared expert), so no
    key says it: `qwen3_moe_check` refuses configs that route otherwise."""
    return {
        gguf.Keys.LLM.EXPERT_COUNT: expert_count(config),
        gguf.Keys.LLM.EXPERT_USED_COUNT: int(config["num_experts_per_tok"]),
        gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: int(config["moe_intermediate_size"]),
    }


def qwen3_moe_check(config: dict[str, Any]) -> str | None:
    """What llama.cpp's qwen3moe (0.3.36, src/models/qwen3moe.cpp) cannot reproduce: dense layers (it builds every
    layer's MLP as experts), top-k weights left unnormalized, attention biases (it loads no output bias), and a
    sliding window (it attends to the whole context)."""
    n = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = [i for i in range(n) if i in (config.get("mlp_only_layers") or []) or (i + 1) % step]
    if dense or not expert_count(config):
        where = dense or "all"
        return f"dense MLP layers {where} (mlp_only_layers, decoder_sparse_step): llama.cpp's qwen3moe has none"
    if not config.get("norm_topk_prob"):
        return "norm_topk_prob is false: llama.cpp's qwen3moe always renormalizes the top-k expert weights"
    if config.get("attention_bias"):
        return "attention_bias: llama.cpp's qwen3moe has no attention output bias"
    if config.get("use_sliding_window") and config.get("sliding_window"):
        return "use_sliding_window: llama.cpp's qwen3moe attends to the whole context"
    return None


def gpt_oss_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's gpt-oss (its openai-moe loader) reads: the expert counts and width (gpt-oss's experts are
    `intermediate_size` wide), the sliding window and the per-layer window pattern (transformers' layer_types)."""
    return {
        gguf.Keys.LLM.EXPERT_COUNT: expert_count(config),
        gguf.Keys.LLM.EXPERT_USED_COUNT: int(config["num_experts_per_tok"]),
        gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: int(config["intermediate_size"]),
        gguf.Keys.Attention.SLIDING_WINDOW: int(config["sliding_window"]),
        gguf.Keys.Attention.SLIDING_WINDOW_PATTERN: _layer_types(config, lambda i: (i + 1) % 2 == 1),
    }


def gpt_oss_check(config: dict[str, Any]) -> str | None:
    """What llama.cpp's gpt-oss (0.3.36, src/models/openai-moe.cpp) cannot reproduce: its clamped SwiGLU has alpha
    1.702 and limit 7.0 compiled in, its attention needs biases and a head width equal to the rotary width, and
    it has no full-attention-only variant (the window is read for the sliding layers)."""
    alpha, limit = float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))
    if (alpha, limit) != (1.702, 7.0):
        return f"swiglu_alpha {alpha} / swiglu_limit {limit}: llama.cpp's gpt-oss computes with 1.702 / 7.0"
    if config.get("attention_bias") is False:
        return "attention_bias is false: llama.cpp's gpt-oss loads attention biases"
    if not config.get("sliding_window"):
        return "no sliding_window: llama.cpp's gpt-oss reads one for its sliding layers"
    return None
