"""The model families slimtune supports: one row per architecture, the only list of them in the code.

Every stage reads its facts from here: the spec's builtin tiny names and `check_architecture` (which
families exist), the tiny-model builder (config quirks), attach_lora (LoRA target names), the kernel
selection (which Triton kernels match the family's math, and why the others fall back to eager), the
memory estimates (shape quirks), and the GGUF converter (llama.cpp architecture, tensor layout and
hyper-parameters). Adding a dense architecture means adding a row; its GGUF tensor names come from
`gguf`'s own tables (`gguf.MODEL_TENSORS`, `gguf.TensorNameMap`).

The functions a row names for its GGUF keys and refusals are in `slimtune.models.family_configs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf

from slimtune.models.family_configs import (
    gemma2_hparams,
    gemma3_hparams,
    gemma4_check,
    gemma4_hparams,
    gemma_attention_scale,
    gpt_oss_check,
    gpt_oss_hparams,
    granite_check,
    granite_hparams,
    phi3_check,
    phi3_hparams,
    qwen3_moe_check,
    qwen3_moe_hparams,
    qwen35_check,
    qwen35_hparams,
    smollm3_check,
)
from slimtune.models.multimodal import LAYOUTS, layout_of, layout_problem, text_model_config

# The Triton kernels of slimtune.kernels (defined here so that the spec can validate names without
# importing torch): each family says, per kernel, either that it applies or why that part stays eager.
KERNEL_NAMES: tuple[str, ...] = (
    "rms_norm",
    "rope",
    "swiglu",
    "geglu",
    "fused_linear_ce",
    "lora_nf4",
    "host_embedding",
    "host_lm_head",
)
_NOT_SILU = "the MLP activation is GELU (geglu applies)"
_NOT_GELU = "the MLP activation is SiLU (swiglu applies)"
# host_lm_head goes to host memory with the input table (both loaded there: `slimtune.tasks.load_tables`), and only
# the fused loss streams it
_HEAD_NEEDS_FUSED_LOSS = "the loss stays eager here (fused_linear_ce), and only the fused loss streams the head"
_HEAD_WITH_TABLE = "the input table stays on the GPU here (host_embedding), and the head goes to host memory with it"
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
    # Hybrid models (Qwen3.5): the linear-attention layers' projections, trained wherever attention's are (a
    # target list naming any of q/k/v/o_proj gets them too), so the default targets reach every layer's mixer.
    linear_attention_targets: tuple[str, ...] = ()
    frozen_linears: tuple[str, ...] = ()  # a layer's other linears, which the default targets leave frozen
    # Mixture of experts (Qwen3-MoE): the MLP projections are every expert's, held per layer by one
    # `slimtune.kernels.nf4_experts.NF4Experts`, which takes their LoRA itself (peft does not reach 3-D tensors)
    experts: bool = False
    # gpt-oss: the checkpoint stores each layer's experts as the model holds them (`<block>.gate_up_proj` [E, in, 2I],
    # gate and up interleaved by column, with biases), not per expert (`slimtune.models.experts.FUSED_STORED`)
    fused_experts: bool = False
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
    # learned per-head attention sinks (gpt-oss): transformers passes them to eager and flex attention; flash-attn 2
    # and slimtune's varlen attention would drop them silently, so "auto" attention stays eager
    attention_sinks: bool = False
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


_LLAMA_KERNELS = ("rms_norm", "rope", "swiglu", "fused_linear_ce", "lora_nf4", "host_embedding", "host_lm_head")
_GEMMA_KERNELS = ("rms_norm", "rope", "geglu", "fused_linear_ce", "lora_nf4", "host_embedding", "host_lm_head")
_DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")  # Gated DeltaNet in/out projections
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

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
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        # Every layer sparse, 8 experts with 2 per token (Qwen3-30B-A3B: 128 and 8); the expert width a multiple of
        # 256 so that the GGUF k-quants apply to the stacked expert tensors.
        tiny={
            "head_dim": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,  # as the released checkpoints; llama.cpp always renormalizes the top-k weights
        },
        kernels=("rms_norm", "rope", "fused_linear_ce", "lora_nf4", "host_embedding", "host_lm_head"),
        eager={
            "swiglu": "the experts' gate and up are one 3-D tensor per layer, run by slimtune.kernels.nf4_experts",
            "geglu": _NOT_GELU,
        },
        experts=True,
        layer_output=None,  # a layer's MLP output is the routed experts' weighted sum, not one linear
        qk_norm="head",
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.QWEN3MOE,
        gguf_hparams=qwen3_moe_hparams,
        check_config=qwen3_moe_check,
        tokenizer_pre="qwen2",
        chat_template="chatml",
    ),
    Family(
        "gpt_oss",
        "GptOssForCausalLM",
        "GptOssConfig",
        # 4 layers alternating sliding (window 16, so the test prompts slide) and full attention, 8 experts with 2
        # per token (gpt-oss-20b: 32 and 4) 256 wide for the GGUF k-quants; plain rope (the released yarn is
        # converted by `_add_rope_scaling`); biases on the experts random, as trained ones are (init: zeros).
        tiny={
            "head_dim": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 256,
            "sliding_window": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
        },
        kernels=("fused_linear_ce", "lora_nf4", "host_embedding", "host_lm_head"),
        eager={
            "rms_norm": "the norms multiply by the weight before casting back (kept in fp32)",
            "rope": "attention adds learned sinks (s_aux), which the patched attention forward does not pass on",
            "swiglu": "the experts' gate and up are one interleaved 3-D tensor, run by slimtune.kernels.nf4_experts",
            "geglu": _NOT_GELU,
        },
        experts=True,
        fused_experts=True,
        layer_output=None,  # a layer's MLP output is the routed experts' weighted sum, not one linear
        qkv_bias=True,  # and o_proj's
        sliding_window_kwarg=True,
        sdpa=False,  # transformers runs gpt-oss's sinks in eager (or flash/flex) attention only
        attention_sinks=True,
        gguf_arch=gguf.MODEL_ARCH.GPT_OSS,
        gguf_hparams=gpt_oss_hparams,
        check_config=gpt_oss_check,
        tokenizer_pre="gpt-4o (o200k_harmony)",
        chat_template="gpt-oss (harmony)",
    ),
    Family(
        "qwen3_5_text",
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        # Qwen3.5's layer pattern (three Gated DeltaNet layers, then one gated full-attention layer: 4 layers) and
        # its quarter-width rotary; 4 value heads on 2 key heads, as the released 2:1, so the converter's
        # head reorder is exercised.
        tiny={
            "head_dim": 64,
            "num_hidden_layers": 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
        kernels=("swiglu", "fused_linear_ce", "lora_nf4", "host_embedding", "host_lm_head"),
        eager={
            "rms_norm": "the DeltaNet's output norm is gated (Qwen3_5RMSNormGated), which the kernel does not do",
            "rope": "a quarter of each head rotates, and q_proj carries the output gate beside the queries",
            "geglu": _NOT_GELU,
        },
        # attention, the DeltaNet's input and output projections, the MLP; conv1d, A_log, dt_bias and norms stay frozen
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", *_DELTANET, "gate_proj", "up_proj", "down_proj"),
        linear_attention_targets=_DELTANET,
        norm_offset=1.0,  # (1 + w), except the DeltaNet's gated norm (slimtune.export.gguf_deltanet)
        qk_norm="head",
        layer_norms=3,  # input and post-attention norms, and the DeltaNet's gated output norm (linear layers)
        gguf_arch=gguf.MODEL_ARCH.QWEN35,
        gguf_hparams=qwen35_hparams,
        check_config=qwen35_check,
        tokenizer_pre="qwen35",
        chat_template="qwen3.5 (ChatML with <think> blocks)",
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
            "host_lm_head": _HEAD_NEEDS_FUSED_LOSS,
        },
        layer_output=None,
        norm_offset=1.0,
        tied_default=True,
        layer_norms=4,
        sliding_window_kwarg=True,
        sdpa=False,
        gguf_arch=gguf.MODEL_ARCH.GEMMA2,
        gguf_hparams=gemma2_hparams,
        check_config=gemma_attention_scale,
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
            "host_lm_head": _HEAD_WITH_TABLE,
        },
        layer_output=None,
        norm_offset=1.0,
        tied_default=True,
        qk_norm="head",
        layer_norms=4,
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.GEMMA3,
        gguf_hparams=gemma3_hparams,
        check_config=gemma_attention_scale,
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
            "host_lm_head": _HEAD_WITH_TABLE,
        },
        frozen_linears=("per_layer_input_gate", "per_layer_projection"),
        layer_output=None,
        tied_default=True,
        qk_norm="head",
        layer_norms=5,  # Gemma 3's four and the per-layer input's post-norm (v_norm has no weight)
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.GEMMA4,
        gguf_hparams=gemma4_hparams,
        check_config=gemma4_check,
        tokenizer_pre="gemma4 (llama.cpp's own tokenizer model)",
        chat_template="gemma4",
    ),
    Family(
        "phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        # Phi-4-mini's partial rotary (3/4 of each head rotates); Phi-3's 2047-token window, which llama.cpp ignores
        tiny={"partial_rotary_factor": 0.75, "sliding_window": 2047, "rms_norm_eps": 1e-5},
        kernels=("rms_norm", "fused_linear_ce", "lora_nf4", "host_embedding", "host_lm_head"),
        eager={
            "rope": "q, k and v come from one fused qkv_proj",
            "swiglu": _FUSED_GATE_UP,
            "geglu": _FUSED_GATE_UP,
        },
        lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
        sliding_window_kwarg=True,
        gguf_arch=gguf.MODEL_ARCH.PHI3,
        gguf_hparams=phi3_hparams,
        check_config=phi3_check,
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
            "host_lm_head": _HEAD_NEEDS_FUSED_LOSS,
        },
        tied_default=True,
        permute_qk=True,  # llama.cpp's granite uses LLAMA-style rope
        gguf_arch=gguf.MODEL_ARCH.GRANITE,
        gguf_hparams=granite_hparams,
        check_config=granite_check,
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
        check_config=smollm3_check,
        tokenizer_pre="llama-bpe",
        chat_template="smollm3 (ChatML with a /think, /no_think system header)",
    ),
    Family(
        "olmo2",
        "Olmo2ForCausalLM",
        "Olmo2Config",
        tiny={},
        kernels=("swiglu", "fused_linear_ce", "lora_nf4", "host_embedding", "host_lm_head"),
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
    if layout_of(config) is not None:  # its language model is trained: that model's config decides
        return layout_problem(config) or check_architecture(text_model_config(config))
    model_type = config.get("model_type", "?")
    archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
    family = FAMILIES.get(str(model_type))
    if family is None:
        return (
            f"model.name_or_path: architecture {model_type!r} ({archs}) is not supported; slimtune supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (dense decoder-only models) and the language model of "
            f"{', '.join(LAYOUTS)} multimodal checkpoints (mixture-of-experts and other multimodal checkpoints "
            "are not)"
        )
    problem = family.check_config(config) if family.check_config else None
    if problem:
        return f"model.name_or_path: {model_type} config: {problem}; slimtune cannot export it to GGUF faithfully"
    return None
