"""A decoder's dimensions as the memory estimates count them, read from a Hugging Face `config.json` dict.

One `ModelShape` per config: the sizes of every linear of each decoder layer (Gemma 4's layers differ from each
other), the 16-bit embedding tables and the small norm and bias weights, with the family quirks from
`slimtune.models.families` (tied heads, q/k norms, biases). Anything outside the family table gets plain Llama
arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from slimtune.models.experts import HELD, expert_count
from slimtune.models.families import Family, family_of, text_fields
from slimtune.models.family_configs import full_attention_head_dim, gemma4_sliding_layers, linear_attention_layers

_MLP = tuple(p for held in HELD.values() for p in held)  # an MoE's per-expert projections


@dataclass(frozen=True)
class ModelShape:
    """The sizes the estimates multiply: the usual config dimensions, plus each layer's linears where they differ."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: str  # "", "head" or "full" (see slimtune.models.families)
    layer_norms: int
    model_type: str
    # Gemma 4: layers that differ (wider global heads, KV-shared layers without k/v) and per-layer inputs
    layer_linears: tuple[dict[str, tuple[int, int]], ...] = ()  # each layer's linears where they differ
    other_linears: int = 0  # NF4 linear weights outside the layers (Gemma 4's per-layer input projection)
    other_embeddings: int = 0  # other 16-bit embedding tables (Gemma 4's per-layer embeddings)
    other_small: int = 0  # norms and scalars beyond the uniform per-layer count (negative where layers have fewer)
    # Mixture of experts (Qwen3-MoE): each MLP projection is `experts` matrices of one expert's size (`intermediate`
    # is moe_intermediate_size), of which each token goes through `experts_per_token`
    experts: int = 0
    experts_per_token: int = 0
    # Hybrid models (Qwen3.5): some layers are Gated DeltaNet (linear attention), which keep more activations
    linear_attention: bool = False
    # Attention that materializes each head's scores (gpt-oss's learned sinks keep it on transformers' eager path):
    # heads x seq x seq per row, beside the per-token activations
    eager_attention: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear in a decoder layer (the largest of each where layers differ)."""
        if self.layer_linears:
            names = dict.fromkeys(n for layer in self.layer_linears for n in layer)
            return {n: max(layer[n] for layer in self.layer_linears if n in layer) for n in names}
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def copies(self, name: str) -> int:
        """How many matrices a layer holds under projection `name`: every expert's for an MoE's MLP projections."""
        return self.experts if self.experts and name in _MLP else 1

    def routed(self, name: str) -> int:
        """Through how many of those matrices each token goes (`copies` for weights, this for activations)."""
        return self.experts_per_token if self.experts and name in _MLP else 1

    def linear_weights_per_layer(self) -> int:
        return sum(a * b * self.copies(n) for n, (a, b) in self.projections().items())

    def each_layer(self) -> tuple[dict[str, tuple[int, int]], ...]:
        """Every decoder layer's linears, in order."""
        return self.layer_linears or (self.projections(),) * self.layers

    def embedding_weights(self) -> int:
        """Input embeddings plus an untied lm_head; both stay 16-bit under bitsandbytes."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.other_embeddings

    def small_weights(self) -> int:
        """Norms and biases: never quantised, negligible for large models but exact for tiny ones."""
        qk = {"head": 2 * self.head_dim, "full": self.q_dim + self.kv_dim}.get(self.qk_norm, 0)
        per_layer = self.layer_norms * self.hidden + qk
        per_layer += (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return self.layers * per_layer + self.hidden + self.other_small

    def total_weights(self) -> int:
        linears = sum(a * b * self.copies(n) for layer in self.each_layer() for n, (a, b) in layer.items())
        linears += self.other_linears
        return linears + self.embedding_weights() + self.small_weights()


def model_shape(cfg: dict[str, Any]) -> ModelShape:
    """Read the dimensions that matter from a config dict; multimodal configs nest `text_config`."""
    text = text_fields(cfg)
    missing = [
        k
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        if k not in text
    ]
    if missing:
        raise ValueError(
            f"config.json lacks {', '.join(missing)}; memory estimates support dense decoder configs "
            "(slimtune.models.families)"
        )
    model_type = str(text.get("model_type", "llama"))
    family = family_of(text)  # shape quirks of the family; plain Llama arithmetic for anything else
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    shape = ModelShape(
        hidden=hidden,
        intermediate=int(text["intermediate_size"]),
        layers=int(text["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        vocab=int(text["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", family and family.tied_default))),
        qkv_bias=bool(text.get("attention_bias", family and family.qkv_bias)),
        qk_norm=family.qk_norm if family else "",
        layer_norms=family.layer_norms if family else 2,
        model_type=model_type,
        eager_attention=bool(family and family.attention_sinks),
    )
    if model_type == "qwen3_5_text":
        return _qwen35_layers(text, shape)
    if family is not None and family.experts:
        return _moe_layers(text, shape, family)
    return _gemma4_layers(text, shape) if model_type == "gemma4_text" else shape


def _gemma4_layers(text: dict[str, Any], shape: ModelShape) -> ModelShape:
    """Gemma 4's layers as transformers builds them: global layers with `global_head_dim` (and k as v where
    attention_k_eq_v), the last num_kv_shared_layers without k/v, and a per-layer input gate and projection
    fed by a 16-bit per-layer embedding table (E2B: 262144 x 35 x 256 = 2.3e9 weights, more than the rest)."""
    h, n = shape.hidden, shape.layers
    full_dim, per_input = full_attention_head_dim(text), int(text.get("hidden_size_per_layer_input") or 0)
    shared_from = n - int(text.get("num_kv_shared_layers") or 0)
    per_layer_config = text.get("per_layer_config") or {}
    layers, small = [], n + per_input  # each layer's layer_scalar; the per-layer projection's norm
    for i, sliding in enumerate(gemma4_sliding_layers(text)):
        full, shared = not sliding, i >= shared_from
        head_dim = full_dim if full else shape.head_dim
        kv = head_dim * int(per_layer_config.get(str(i), {}).get("num_key_value_heads", shape.kv_heads))
        inter = shape.intermediate * (2 if text.get("use_double_wide_mlp") and shared else 1)
        layer = {"q_proj": (h, shape.heads * head_dim)}
        if not shared:
            layer |= {"k_proj": (h, kv)} | ({} if full and text.get("attention_k_eq_v") else {"v_proj": (h, kv)})
        layer |= {"o_proj": (shape.heads * head_dim, h), "gate_proj": (h, inter), "up_proj": (h, inter)}
        layer |= {"down_proj": (inter, h)}
        if per_input:
            layer |= {"per_layer_input_gate": (h, per_input), "per_layer_projection": (per_input, h)}
        layers.append(layer)
        small += head_dim * (1 if shared else 2) - 2 * shape.head_dim  # q_norm, k_norm at this layer's width
    return replace(
        shape,
        layer_linears=tuple(layers),
        other_linears=h * n * per_input,
        other_embeddings=int(text.get("vocab_size_per_layer_input") or 0) * n * per_input,
        other_small=small,
    )


def _qwen35_layers(text: dict[str, Any], shape: ModelShape) -> ModelShape:
    """Qwen3.5's hybrid layers: Gated DeltaNet layers (in_proj_qkv/z/a/b, out_proj; a 16-bit depthwise conv1d,
    A_log, dt_bias and a head-wide gated norm) and full-attention layers whose q_proj also emits the output gate
    (2 x heads x head_dim), with q/k norms. The estimates' activation count treats every layer as attention
    of the config's width, scaled for the DeltaNet's larger saves (`linear_attention`); they keep no KV cache."""
    h, inter = shape.hidden, shape.intermediate
    k_dim = int(text["linear_key_head_dim"]) * int(text["linear_num_key_heads"])
    v_heads, v_head_dim = int(text["linear_num_value_heads"]), int(text["linear_value_head_dim"])
    v_dim = v_heads * v_head_dim
    mlp = {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    layers, small = [], 0
    for linear in linear_attention_layers(text):
        if linear:
            layers.append(
                {"in_proj_qkv": (h, 2 * k_dim + v_dim), "in_proj_z": (h, v_dim), "in_proj_a": (h, v_heads)}
                | {"in_proj_b": (h, v_heads), "out_proj": (v_dim, h)}
                | mlp
            )
            conv = (2 * k_dim + v_dim) * int(text["linear_conv_kernel_dim"])
            small += conv + 2 * v_heads + v_head_dim - h - 2 * shape.head_dim  # no q/k norms; a head-wide norm
        else:
            layers.append(
                {"q_proj": (h, 2 * shape.q_dim), "k_proj": (h, shape.kv_dim), "v_proj": (h, shape.kv_dim)}
                | {"o_proj": (shape.q_dim, h)}
                | mlp
            )
            small -= h  # layer_norms counts the DeltaNet's third norm on every layer
    return replace(shape, layer_linears=tuple(layers), other_small=small, linear_attention=True)


def _moe_layers(text: dict[str, Any], shape: ModelShape, family: Family) -> ModelShape:
    """An MoE's layers: attention, then `num_experts` experts of moe_intermediate_size (Qwen3-MoE; gpt-oss's are
    intermediate_size wide) held in NF4 by `slimtune.kernels.nf4_experts`, behind a 16-bit router of num_experts x
    hidden weights. gpt-oss adds 16-bit biases to every expert (gate_up's 2I, down's H), the router and o_proj, and
    one attention sink per head."""
    experts, h = expert_count(text), shape.hidden
    inter = int(text.get("moe_intermediate_size") or text["intermediate_size"])
    per_layer = experts * h
    if family.fused_experts:
        per_layer += experts * (2 * inter + h) + experts + h + shape.heads
    return replace(
        shape,
        intermediate=inter,
        experts=experts,
        experts_per_token=int(text["num_experts_per_tok"]),
        other_small=shape.other_small + shape.layers * per_layer,
    )
