"""The model families slimtune supports: one row per architecture, the only list of them in the code.

Every stage reads its facts from here: the spec's builtin tiny names and `check_architecture` (which
families exist), the tiny-model builder (config quirks), attach_lora (LoRA target names), the kernel
selection (which Triton kernels match the family's math, and why the others fall back to eager), the
memory estimates (shape quirks), and the GGUF converter (llama.cpp architecture, tensor layout and
hyper-parameters). Adding a dense architecture means adding a row; its GGUF tensor names come from
`gguf`'s own tables (`gguf.MODEL_TENSORS`, `gguf.TensorNameMap`).

What llama.cpp needs was read in llama.cpp's model loaders as vendored by llama-cpp-python 0.3.36
(`src/models/<arch>.cpp`) and checked by converting each tiny model and comparing llama.cpp's logits
with transformers' (tests/test_gguf_quant_verify.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf

# The Triton kernels of slimtune.kernels (defined here so that the spec can validate names without
# importing torch): each family says, per kernel, either that it applies or why that part stays eager.
KERNEL_NAMES: tuple[str, ...] = ("rms_norm", "rope", "swiglu", "geglu", "fused_linear_ce", "lora_nf4", "host_embedding")
_NOT_SILU = "the MLP activation is GELU (geglu applies)"
_NOT_GELU = "the MLP activation is SiLU (swiglu applies)"
_FUSED_GATE_UP = "gate and up are one fused gate_up_proj; the gated kernels need separate projections"


@dataclass(frozen=True)
class Family:
    """What slimtune needs to know about one architecture, from loading to GGUF."""

    model_type: str  # config.json "model_type"; also the builtin tiny model's name
    architecture: str  # config.json "architectures"[0], the transformers class
    config_class: str  # the transformers config class (tiny builds)
    tiny: dict[str, Any]  # the real config quirks the tiny model carries (beyond the shared tiny sizes)
    kernels: tuple[str, ...]  # Triton kernels whose math matches this family
    eager: dict[str, str]  # every other kernel -> why that part stays eager here
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)  # fused linear -> the projections it holds
    frozen_linears: tuple[str, ...] = ()  # a layer's other linears, which the default targets leave frozen
    # The projection whose output is only summed into the residual stream (no norm reads it), so a
    # checkpointing recompute may skip computing it; None where a post-norm reads it (Gemma 2/3, OLMo 2).
    layer_output: str | None = "mlp.down_proj"
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w); GGUF stores offset + w (Gemma: 1)
    tied_default: bool = False  # lm_head shares embed_tokens when config.json does not say
    qkv_bias: bool = False  # q/k/v projections carry biases by default
    qk_norm: str = ""  # RMSNorm on q and k: "head" (per head: Qwen3, Gemma 3), "full" (whole projection: OLMo 2)
    layer_norms: int = 2  # RMSNorms per decoder layer besides q/k norms (Gemma 2/3 add post-norms: 4)
    sliding_window_kwarg: bool = False  # the attention forward passes `sliding_window` on
    sdpa: bool = True  # transformers runs it through SDPA (Gemma 2: no, SDPA has no soft-capping)
    gguf_arch: gguf.MODEL_ARCH = gguf.MODEL_ARCH.LLAMA
    permute_qk: bool = False  # llama.cpp's LLAMA-style rope wants q/k rows interleaved, not halves
    gguf_hparams: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # extra GGUF keys ({arch} form)
    check_config: Callable[[dict[str, Any]], str | None] | None = None  # what llama.cpp cannot reproduce
    # Informative, read by no code (the converter derives the pre-tokenizer from tokenizer.json and refuses
    # what it cannot match): what the released checkpoints use, per llama.cpp's convert_hf_to_gguf tables.
    tokenizer_pre: str = ""  # llama.cpp pre-tokenizer of the released checkpoints' tokenizer
    chat_template: str = ""  # chat template family of the released instruct checkpoints

    @property
    def gguf_name(self) -> str:
        """The llama.cpp architecture name written to `general.architecture`."""
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]


def _layer_types(config: dict[str, Any], default: Callable[[int], bool]) -> list[bool]:
    """Per layer, True where attention is sliding-window (transformers 5 `layer_types`, else the pattern)."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    return [default(i) for i in range(n)]


def _gemma2_hparams(config: dict[str, Any]) -> dict[str, Any]:
    attn, final = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
    return {
        gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING: None if attn is None else float(attn),
        gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING: None if final is None else float(final),
        gguf.Keys.Attention.SLIDING_WINDOW: config["sliding_window"],
        # llama.cpp's default Gemma 2 pattern is every other layer; the exact per-layer list is written
        gguf.Keys.Attention.SLIDING_WINDOW_PATTERN: _layer_types(config, lambda i: (i + 1) % 2 == 1),
    }


def _gemma3_hparams(config: dict[str, Any]) -> dict[str, Any]:
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


def _gemma_attention_scale(config: dict[str, Any]) -> str | None:
    """llama.cpp scales Gemma 2/3 queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B sizes),
    while transformers uses query_pre_attn_scalar: refuse a config where the two differ."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    scalar = config.get("query_pre_attn_scalar", head_dim)
    big = int(config["num_hidden_layers"]) in ((46, 62) if config["model_type"] == "gemma3_text" else (46,))
    expected = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
    if scalar != expected:
        return f"query_pre_attn_scalar {scalar} differs from the {expected} llama.cpp uses for this size"
    return None


def _phi3_hparams(config: dict[str, Any]) -> dict[str, Any]:
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


def _phi3_check(config: dict[str, Any]) -> str | None:
    """Phi-3 128k / Phi-3.5 / Phi-4-mini extend context with longrope, which llama.cpp's phi3 takes as
    rope_factors_long/short tensors (one factor per rotary frequency); any other rope scaling it does not."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("longrope", "su"):
        return f"rope scaling {kind!r} is not converted for phi3 (only longrope, which llama.cpp's phi3 reads)"
    n_freq = _phi3_hparams(config)[gguf.Keys.Rope.DIMENSION_COUNT] // 2
    for key in ("long_factor", "short_factor"):
        n = len(rope.get(key) or [])
        if n != n_freq:
            return f"longrope {key} has {n} values; llama.cpp needs one per rotary frequency ({n_freq})"
    return None


def _granite_hparams(config: dict[str, Any]) -> dict[str, Any]:
    return {
        gguf.Keys.LLM.EMBEDDING_SCALE: float(config.get("embedding_multiplier", 1.0)),
        gguf.Keys.LLM.RESIDUAL_SCALE: float(config.get("residual_multiplier", 1.0)),
        gguf.Keys.Attention.SCALE: float(config.get("attention_multiplier", 1.0)),
        gguf.Keys.LLM.LOGIT_SCALE: float(config.get("logits_scaling", 1.0)),
    }


def _granite_check(config: dict[str, Any]) -> str | None:
    head_dim = config.get("head_dim")
    if head_dim and head_dim != config["hidden_size"] // config["num_attention_heads"]:
        return f"head_dim {head_dim} is not hidden_size / num_attention_heads, which llama.cpp's granite assumes"
    return None


def _smollm3_check(config: dict[str, Any]) -> str | None:
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


def _gemma4_hparams(config: dict[str, Any]) -> dict[str, Any]:
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


def _gemma4_check(config: dict[str, Any]) -> str | None:
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


_LLAMA_KERNELS = ("rms_norm", "rope", "swiglu", "fused_linear_ce", "lora_nf4", "host_embedding")
_GEMMA_KERNELS = ("rms_norm", "rope", "geglu", "fused_linear_ce", "lora_nf4", "host_embedding")

_ROWS = (
    Family(
        "llama",
        "LlamaForCausalLM",
        "LlamaConfig",
        tiny={},
        kernels=_LLAMA_KERNELS,
        eager={"geglu": _NOT_GELU},
        permute_qk=True,
        tokenizer_pre="llama-bpe",
        chat_template="llama3",
    ),
    Family(
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        tiny={"sliding_window": None, "head_dim": 64},
        kernels=_LLAMA_KERNELS,
        eager={"geglu": _NOT_GELU},
        sliding_window_kwarg=True,
        permute_qk=True,  # llama.cpp runs Mistral as its llama architecture
        tokenizer_pre="default (SentencePiece; Mistral-Nemo: tekken)",
        chat_template="mistral",
    ),
    Family(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        tiny={},
        kernels=_LLAMA_KERNELS,
        eager={"geglu": _NOT_GELU},
        qkv_bias=True,
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.QWEN2,
        tokenizer_pre="qwen2",
        chat_template="chatml",
    ),
    Family(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        tiny={"head_dim": 64},
        kernels=_LLAMA_KERNELS,
        eager={"geglu": _NOT_GELU},
        qk_norm="head",
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.QWEN3,
        tokenizer_pre="qwen2",
        chat_template="chatml",
    ),
    Family(
        "gemma",
        "GemmaForCausalLM",
        "GemmaConfig",
        tiny={"head_dim": 64, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"},
        kernels=_GEMMA_KERNELS,
        eager={"swiglu": _NOT_SILU},
        norm_offset=1.0,
        tied_default=True,
        gguf_arch=gguf.MODEL_ARCH.GEMMA,
        tokenizer_pre="default (SentencePiece)",
        chat_template="gemma",
    ),
    Family(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        # Softcaps far below the released 50/30 so that a converter that dropped them fails the logit
        # comparison (tiny attention scores are O(0.1) and logits O(1), where caps of 50/30 are the
        # identity); window 16 so that the test prompts (up to ~60 tokens) really slide.
        tiny={
            "head_dim": 64,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": 0.2,
            "final_logit_softcapping": 3.0,
            "sliding_window": 16,
            "query_pre_attn_scalar": 64,
        },
        kernels=("rms_norm", "geglu", "lora_nf4", "host_embedding"),
        eager={
            "swiglu": _NOT_SILU,
            "rope": "attention soft-capping: the kernel's attention path does not pass softcap on",
            "fused_linear_ce": "final logit soft-capping: the fused loss has no softcap",
        },
        layer_output=None,
        norm_offset=1.0,
        tied_default=True,
        layer_norms=4,
        sliding_window_kwarg=True,
        sdpa=False,
        gguf_arch=gguf.MODEL_ARCH.GEMMA2,
        gguf_hparams=_gemma2_hparams,
        check_config=_gemma_attention_scale,
        tokenizer_pre="default (SentencePiece)",
        chat_template="gemma",
    ),
    Family(
        "gemma3_text",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        # Six layers: five sliding-window layers with a local rope base, then one global layer.
        tiny={
            "head_dim": 64,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 16,
            "query_pre_attn_scalar": 64,
            "num_hidden_layers": 6,
        },
        kernels=("rms_norm", "rope", "geglu", "fused_linear_ce", "lora_nf4"),
        eager={
            "swiglu": _NOT_SILU,
            "host_embedding": "the input embedding is a scaled subclass (Gemma3TextScaledWordEmbedding)",
        },
        layer_output=None,
        norm_offset=1.0,
        tied_default=True,
        qk_norm="head",
        layer_norms=4,
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.GEMMA3,
        gguf_hparams=_gemma3_hparams,
        check_config=_gemma_attention_scale,
        tokenizer_pre="default (SentencePiece)",
        chat_template="gemma",
    ),
    Family(
        "gemma4_text",
        "Gemma4ForCausalLM",
        "Gemma4TextConfig",
        # Six layers (five sliding, one global with a 128-wide head and proportional rope) with per-layer inputs;
        # KV sharing needs more layers of each type than the 1-2 layer builds have: tests/test_family_gemma4.py.
        tiny={
            "head_dim": 64,
            "global_head_dim": 128,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 16,
            "num_hidden_layers": 6,
            "hidden_size_per_layer_input": 64,
        },
        kernels=("geglu", "fused_linear_ce", "lora_nf4"),
        eager={
            "rms_norm": "v_norm has no weight, and the norms multiply by the weight before casting back",
            "rope": "attention normalises v, shares KV across layers and rotates part of the global heads",
            "swiglu": _NOT_SILU,
            "host_embedding": "the input embedding is a scaled subclass (Gemma4TextScaledWordEmbedding)",
        },
        frozen_linears=("per_layer_input_gate", "per_layer_projection"),
        layer_output=None,
        tied_default=True,
        qk_norm="head",
        layer_norms=5,  # Gemma 3's four and the per-layer input's post-norm (v_norm has no weight)
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.GEMMA4,
        gguf_hparams=_gemma4_hparams,
        check_config=_gemma4_check,
        tokenizer_pre="gemma4 (llama.cpp's own tokenizer model)",
        chat_template="gemma4",
    ),
    Family(
        "phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        # Phi-4-mini's partial rotary (3/4 of each head rotates); Phi-3's 2047-token window, which llama.cpp ignores
        tiny={"partial_rotary_factor": 0.75, "sliding_window": 2047, "rms_norm_eps": 1e-5},
        kernels=("rms_norm", "fused_linear_ce", "lora_nf4", "host_embedding"),
        eager={
            "rope": "q, k and v come from one fused qkv_proj",
            "swiglu": _FUSED_GATE_UP,
            "geglu": _FUSED_GATE_UP,
        },
        lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.PHI3,
        gguf_hparams=_phi3_hparams,
        check_config=_phi3_check,
        tokenizer_pre="gpt-4o",
        chat_template="phi3",
    ),
    Family(
        "granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        # granite-3.3-8b's multipliers, but the attention scale 1/64 (not 1/sqrt(64)) for the tiny head_dim
        tiny={
            "tie_word_embeddings": True,
            "embedding_multiplier": 12.0,
            "logits_scaling": 16.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
        },
        kernels=("rms_norm", "rope", "swiglu", "lora_nf4", "host_embedding"),
        eager={
            "geglu": _NOT_GELU,
            "fused_linear_ce": "logits are divided by logits_scaling; the fused loss has no logit scale",
        },
        tied_default=True,
        permute_qk=True,  # llama.cpp's granite uses LLAMA-style rope
        gguf_arch=gguf.MODEL_ARCH.GRANITE,
        gguf_hparams=_granite_hparams,
        check_config=_granite_check,
        tokenizer_pre="refact",
        chat_template="granite",
    ),
    Family(
        "smollm3",
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        # SmolLM3-3B's tied head; its NoPE layers come from the config's default (every 4th: the tiny's layer 3)
        tiny={"tie_word_embeddings": True},
        kernels=_LLAMA_KERNELS,  # rope is patched on the RoPE layers only; NoPE layers keep their own forward
        eager={"geglu": _NOT_GELU},
        tied_default=True,
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.SMOLLM3,
        permute_qk=True,  # llama.cpp's smollm3 uses LLAMA-style rope (its converter is the llama one)
        check_config=_smollm3_check,
        tokenizer_pre="llama-bpe",
        chat_template="smollm3 (ChatML with a /think, /no_think system header)",
    ),
    Family(
        "olmo2",
        "Olmo2ForCausalLM",
        "Olmo2Config",
        tiny={},
        kernels=("swiglu", "fused_linear_ce", "lora_nf4", "host_embedding"),
        eager={
            "rms_norm": "OLMo 2 multiplies by the weight before casting back; the kernel casts first",
            "rope": "q_norm and k_norm normalise the whole projection before the heads are split",
            "geglu": _NOT_GELU,
        },
        layer_output=None,
        qk_norm="full",
        gguf_arch=gguf.MODEL_ARCH.OLMO2,
        tokenizer_pre="dbrx",
        chat_template="olmo2",
    ),
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in _ROWS}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in _ROWS}
assert all(set(f.kernels) | set(f.eager) == set(KERNEL_NAMES) for f in _ROWS), "each kernel: applies or why not"
assert all(not set(f.kernels) & set(f.eager) for f in _ROWS)


def text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with a multimodal config's nested `text_config` laid over it (the decoder's own fields)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def family_of(config: dict[str, Any]) -> Family | None:
    """The family of a config.json dict (multimodal configs nest the text model in `text_config`)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    return FAMILIES.get(str(config.get("model_type"))) or (FAMILIES.get(str(text.get("model_type"))) if text else None)


def check_architecture(config: dict[str, Any]) -> str | None:
    """One line naming the model_type and the supported ones when slimtune cannot run this config, else None."""
    model_type = config.get("model_type", "?")
    archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
    family = FAMILIES.get(str(model_type))
    if family is None:
        return (
            f"model.name_or_path: architecture {model_type!r} ({archs}) is not supported; slimtune supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (dense decoder-only models; mixture-of-experts and multimodal "
            "checkpoints are not)"
        )
    problem = family.check_config(config) if family.check_config else None
    if problem:
        return f"model.name_or_path: {model_type} config: {problem}; slimtune cannot export it to GGUF faithfully"
    return None


def lora_target_modules(model_type: str, requested: list[str] | str) -> list[str] | str:
    """The family's module names for `lora.target_modules`: q/k/v become qkv_proj where they are fused.

    Raises:
        ValueError: a fused family asked for only part of a fused projection (e.g. q_proj alone in Phi-3).
    """
    family = FAMILIES.get(model_type)
    if family is None or isinstance(requested, str) or not family.fused:
        return requested
    part_of = {part: fused for fused, parts in family.fused.items() for part in parts}
    out: list[str] = []
    for name in requested:
        fused = part_of.get(name)
        if fused is None:
            out.append(name)
            continue
        missing = [p for p in family.fused[fused] if p not in requested]
        if missing:
            raise ValueError(
                f"lora.target_modules: {model_type} fuses {', '.join(family.fused[fused])} into {fused}; "
                f"list all of them (missing {', '.join(missing)}) or {fused} itself"
            )
        out.append(fused)
    return list(dict.fromkeys(out))


def canonical_targets(model_type: str, targets: list[str]) -> list[str]:
    """The separate projections behind `targets` (qkv_proj -> q_proj, k_proj, v_proj), for shape arithmetic."""
    family = FAMILIES.get(model_type)
    fused = family.fused if family else {}
    return list(dict.fromkeys(p for t in targets for p in fused.get(t, (t,))))
