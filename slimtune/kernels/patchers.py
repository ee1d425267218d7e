"""The kernel patchers: which module instances of a model each Triton kernel replaces, and how.

Each takes the model (peft unwrapped), its family and the `KernelPatch` that records the undos, and
returns how many modules it patched or why it patched none. Which modules are patched is decided by
explicit type checks per model family; the lora_nf4 patcher is in `lora_nf4_patch`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from slimtune.models.families import FAMILIES

from ._launch import compute_device
from .instance_patch import KernelPatch, replace_forward
from .lora_nf4_patch import patch_lora_nf4

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}


def _family_instances(base: torch.nn.Module, family: str, suffix: str):
    prefix = type(base).__module__  # transformers.models.<family>.modeling_<family>
    for mod in base.modules():
        cls = type(mod)
        if cls.__module__ == prefix and cls.__name__.endswith(suffix):
            yield mod


def _patch_rms_norm(base: torch.nn.Module, family: str, patch: KernelPatch) -> int | str:
    from .rms_norm import rms_norm

    def impl(mod, original, x, gemma):
        eps = mod.variance_epsilon if hasattr(mod, "variance_epsilon") else mod.eps
        return rms_norm(x, mod.weight, eps, gemma)

    count = 0
    for mod in _family_instances(base, family, "RMSNorm"):
        replace_forward(mod, impl, patch, gemma=FAMILIES[family].norm_offset == 1.0)
        count += 1
    return count or "no RMSNorm modules found"


def _patch_rope(base: torch.nn.Module, family: str, patch: KernelPatch) -> int | str:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .rope import rope_

    eager = sys.modules[type(base).__module__].eager_attention_forward
    sliding = FAMILIES[family].sliding_window_kwarg

    def impl(
        mod, original, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs
    ):
        # transformers' attention forward with RoPE done in place on the [B, T, H, D] projections
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, mod.head_dim)
        q, k = mod.q_proj(hidden_states), mod.k_proj(hidden_states)  # rotated whole: see rope_
        v = mod.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if hasattr(mod, "q_norm"):  # Qwen3 normalises each head before rotating
            q, k = mod.q_norm(q.view(hidden_shape)), mod.k_norm(k.view(hidden_shape))
        cos, sin = position_embeddings
        q, k = rope_(q, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, mod.layer_idx)
        impl_name = mod.config._attn_implementation
        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
            interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl_name, eager)
        else:
            interface = eager if impl_name == "eager" else ALL_ATTENTION_FUNCTIONS[impl_name]
        if sliding:
            window = getattr(mod.config, "sliding_window", None)
            kwargs["sliding_window"] = getattr(mod, "sliding_window", window)
        out, weights = interface(
            mod,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not mod.training else mod.attention_dropout,
            scaling=mod.scaling,
            **kwargs,
        )
        return mod.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    count = 0
    for mod in _family_instances(base, family, "Attention"):
        if not getattr(mod, "use_rope", True):
            continue  # a NoPE layer (SmolLM3's every 4th) rotates nothing: its own forward is already right
        if all(hasattr(mod, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            replace_forward(mod, impl, patch)
            count += 1
    return count or "no attention modules with q/k/v/o projections found"


def _hidden_act(mod: torch.nn.Module, base: torch.nn.Module) -> str | None:
    config = getattr(mod, "config", base.config)
    # Gemma 2/3 configs name it hidden_activation only
    return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)


def _mlp_activation(mod: torch.nn.Module, base: torch.nn.Module) -> str | None:
    return _ACTIVATIONS.get(_hidden_act(mod, base))


def _patch_gated(base: torch.nn.Module, family: str, patch: KernelPatch, wanted: tuple[str, ...]) -> int | str:
    from .swiglu import gated_act

    def impl(mod, original, x, activation):
        # gate and up are fresh projection outputs read by nothing else: backward may overwrite them
        return mod.down_proj(gated_act(mod.gate_proj(x), mod.up_proj(x), activation, inplace_backward=True))

    count, seen = 0, set()
    for mod in _family_instances(base, family, "MLP"):
        act = _mlp_activation(mod, base)
        seen.add(_hidden_act(mod, base))
        if act in wanted and all(hasattr(mod, a) for a in ("gate_proj", "up_proj", "down_proj")):
            replace_forward(mod, impl, patch, activation=act)
            count += 1
    return count or f"no gated MLP with activation in {wanted} (found {sorted(map(str, seen))})"


def _patch_swiglu(base, family, patch):
    return _patch_gated(base, family, patch, ("silu",))


def _patch_geglu(base, family, patch):
    return _patch_gated(base, family, patch, ("gelu_tanh", "gelu"))


def _patch_fused_ce(base: torch.nn.Module, family: str, patch: KernelPatch) -> int | str:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from .fused_linear_ce import causal_lm_loss, fused_linear_cross_entropy

    head = getattr(base, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"lm_head is {type(head).__name__} (needs a bias-free torch.nn.Linear; adapters on lm_head?)"
    if getattr(base.config, "final_logit_softcapping", None):
        return "final_logit_softcapping is set; the fused loss has no softcap"
    if not hasattr(base, "model"):
        return "no inner .model to produce hidden states"

    def impl(
        mod,
        original,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        shift_labels = kwargs.pop("shift_labels", None)
        if labels is None and shift_labels is None:
            return original(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("return_dict", None)
        out = mod.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        weight = mod.lm_head.weight
        if shift_labels is not None:
            loss = fused_linear_cross_entropy(
                hidden, weight, shift_labels.to(hidden.device), num_items_in_batch=num_items
            )
        else:
            loss = causal_lm_loss(hidden, weight, labels, num_items_in_batch=num_items)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    replace_forward(base, impl, patch)
    return 1


def _patch_host_embedding(base: torch.nn.Module, family: str, patch: KernelPatch) -> int | str:
    from .host_embedding import gather_rows, to_host

    emb = base.get_input_embeddings()
    if type(emb) is not torch.nn.Embedding or emb.max_norm is not None:
        return f"input embeddings are {type(emb).__name__} (needs a plain torch.nn.Embedding)"
    if emb.weight.requires_grad:
        return "the input embeddings are trained (lora.train_embeddings)"
    head = base.get_output_embeddings()
    if head is not None and head.weight.data_ptr() == emb.weight.data_ptr():
        return "the input embeddings are tied to the output head, which reads them on the GPU"
    gpu = compute_device(base)
    try:
        host = to_host(emb.weight.detach())
        # A probe before the GPU copy goes: pinned memory may be refused (locked-memory limits), or the
        # GPU may not reach it (no unified addressing); either way the table then stays where it is.
        probe = gather_rows(host, torch.zeros(1, dtype=torch.long, device=gpu))
        if not torch.equal(probe[0], emb.weight[0].detach().to(gpu)):  # the table may have been loaded on the host
            return "the GPU read a different row 0 from the host table than the model has"
    except Exception as err:
        return f"host table not usable from {gpu}: {type(err).__name__}: {str(err).splitlines()[0]}"
    return _keep_on_host(emb, host, gpu, patch, lambda mod, original, input_ids: gather_rows(mod.weight, input_ids))


def _patch_host_lm_head(base: torch.nn.Module, family: str, patch: KernelPatch) -> int | str:
    from .host_embedding import to_host
    from .host_lm_head import host_head_logits

    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"lm_head is {type(head).__name__} (needs a bias-free torch.nn.Linear)"
    if head.weight.requires_grad:
        return "lm_head is trained (lora.train_embeddings)"
    emb = base.get_input_embeddings()
    if emb is not None and head.weight.data_ptr() == emb.weight.data_ptr():
        return "lm_head is tied to the input embeddings"
    gpu = compute_device(base)
    if gpu.type != "cuda":
        return f"the model is on {gpu}: there is no GPU memory to spare"
    try:
        host = to_host(head.weight.detach())
    except Exception as err:  # pinned memory refused (locked-memory limits): the head stays where it is
        return f"no pinned host memory for the head: {type(err).__name__}: {str(err).splitlines()[0]}"
    return _keep_on_host(head, host, gpu, patch, lambda mod, original, hidden: host_head_logits(hidden, mod.weight))


def _keep_on_host(module: torch.nn.Module, host: torch.Tensor, gpu: torch.device, patch: KernelPatch, impl) -> int:
    """`module.weight` becomes its host copy `host` (a GPU copy is freed here), its forward `impl`; `undo()` brings
    the weight back to `gpu`."""
    module.weight = torch.nn.Parameter(host, requires_grad=False)
    replace_forward(module, impl, patch)

    def back_to_device() -> None:
        module.weight = torch.nn.Parameter(module.weight.detach().to(gpu), requires_grad=False)

    patch.on_undo(back_to_device)
    return 1


PATCHERS: dict[str, Callable[[torch.nn.Module, str, KernelPatch], int | str]] = {
    "rms_norm": _patch_rms_norm,
    "rope": _patch_rope,
    "swiglu": _patch_swiglu,
    "geglu": _patch_geglu,
    "fused_linear_ce": _patch_fused_ce,
    "lora_nf4": patch_lora_nf4,
    "host_embedding": _patch_host_embedding,
    "host_lm_head": _patch_host_lm_head,
}
