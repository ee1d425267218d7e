"""Select kernels for a loaded model and swap them into its module instances, reversibly.

Patching is per instance: each patched module gets an instance-level `forward` (or, under an
accelerate hook, `_old_forward`) that calls the kernel; the class in transformers/peft is never
touched, so two models in one process can differ and `KernelPatch.undo()` restores each module
exactly. Which modules are patched is decided by explicit type checks per model family.

Selection (`train.kernels` in the spec):
- "off": nothing.
- "auto": on a CUDA GPU of compute capability >= 7.0, every kernel the family supports. On a machine
  without CUDA, nothing (the Triton interpreter runs a 16x256 RMSNorm in 0.17 s, thousands of times
  slower than eager); name kernels explicitly, with TRITON_INTERPRET=1 set before triton is first
  imported, to run them on the CPU (tests do).
- a list of names from `KERNEL_NAMES`: exactly those; a name the family cannot use is skipped with
  its reason in `KernelPatch.skipped`.

"host_embedding" is the one selection that moves a weight: a frozen, untied input-embedding table goes
to pinned host memory (its GPU copy is freed) and `undo()` brings it back; see `host_embedding`.

Loss without logits: with "fused_linear_ce" applied, calling the model with `labels=` (peft-wrapped
or not) returns `CausalLMOutputWithPast(loss=..., logits=None)`; the loss is computed chunk by chunk
from the last hidden state. Labels are unshifted, as for transformers (`shift_labels=` is honoured),
-100 marks prompt/padding tokens, and `num_items_in_batch=` sets the divisor under accumulation.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slimtune.families import FAMILIES, KERNEL_NAMES

from ._launch import interpreter_on

log = logging.getLogger("slimtune.kernels")

# KERNEL_NAMES, and which kernels match which family's math (and why the others stay eager), are in
# slimtune.families.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}


@dataclass
class KernelPatch:
    """What `apply_kernels` did: applied names, skipped names with reasons, and how to undo it."""

    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    modules: dict[str, int] = field(default_factory=dict)  # kernel name -> modules patched
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Restore every patched module's original forward (idempotent).

        Until then the patch references the patched modules: undo (or drop the patch) before freeing a model.
        """
        while self._undo:
            self._undo.pop()()
        self.applied.clear()
        self.modules.clear()


def resolve_selection(selection: str | list[str] | tuple[str, ...], device_type: str, family: str | None) -> list[str]:
    """Kernel names to try for `selection` on `device_type` ("cuda"/"cpu") and model `family`.

    Raises:
        ValueError: unknown names, or explicit names on a CPU without TRITON_INTERPRET=1.
    """
    names, why_none = _resolve(selection, device_type, family)
    if why_none:
        log.info("kernels: %s selects none: %s", selection, why_none)
    return names


def expected_kernels(selection: str | list[str] | tuple[str, ...], device_type: str, family: str | None) -> list[str]:
    """The kernels `apply_kernels` will apply for `selection` on a model of `family` (before it is loaded):
    what memory estimates and the planner assume."""
    names, _ = _resolve(selection, device_type, family)
    usable = FAMILIES[family].kernels if family in FAMILIES else ()
    return [n for n in names if n in usable]


def _resolve(selection, device_type: str, family: str | None) -> tuple[list[str], str]:
    """Names to try, and why `auto` chose none (empty when it chose some or was not asked)."""
    if isinstance(selection, str):
        if selection == "off":
            return [], ""
        if selection == "auto":
            if device_type != "cuda":
                return [], (
                    f"no CUDA device ({device_type}); Triton would run interpreted, thousands of "
                    "times slower than eager. Name kernels explicitly with TRITON_INTERPRET=1 "
                    "to force them"
                )
            if torch.cuda.is_available() and torch.cuda.get_device_capability() < (7, 0):
                return [], f"GPU compute capability {torch.cuda.get_device_capability()} < 7.0"
            if family not in FAMILIES:
                return [], f"model family {family!r} has no kernel mapping (supported: {', '.join(FAMILIES)})"
            return list(FAMILIES[family].kernels), ""
        selection = [s.strip() for s in selection.split(",") if s.strip()]
    unknown = [n for n in selection if n not in KERNEL_NAMES]
    if unknown:
        raise ValueError(
            f"train.kernels: unknown kernel(s) {unknown}; use 'auto', 'off' or names from {list(KERNEL_NAMES)}"
        )
    if selection and device_type != "cuda" and not interpreter_on():
        raise ValueError(
            f"train.kernels: {list(selection)} need a CUDA GPU; on {device_type} set "
            "TRITON_INTERPRET=1 (slow, for tests) or use kernels: off"
        )
    return list(dict.fromkeys(selection)), ""


def _no_pass() -> None:
    """No checkpointing: no pass of a checkpointed layer is ever running."""


def apply_kernels(
    model: torch.nn.Module,
    selection: str | list[str] = "auto",
    exclude: dict[str, str] | None = None,
    *,
    checkpoint_pass: Callable[[], str | None] = _no_pass,
) -> KernelPatch:
    """Swap Triton kernels into `model` (a transformers causal LM, optionally wrapped by peft).

    `exclude` maps kernel names the caller cannot use to the reason, reported in `skipped`.
    `checkpoint_pass` says, at call time, which pass of an "unsloth"-checkpointed layer runs
    (`slimtune.memory.checkpointing.checkpoint_pass`): in "recompute" lora_nf4 skips the output nobody reads, in
    "first" it keeps its adapters' casts for that recompute. Passed in rather than imported, so the kernels do not
    depend on the checkpointing code.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    family = getattr(config, "model_type", None)
    device_type = next(model.parameters()).device.type
    names, why_none = _resolve(selection, device_type, family)
    patch = KernelPatch()
    if why_none:
        patch.skipped = {name: why_none for name in KERNEL_NAMES}
    for name in names:
        if name in (exclude or {}):
            patch.skipped[name] = exclude[name]
            continue
        if family not in FAMILIES:
            patch.skipped[name] = f"not supported for model family {family!r}"
            continue
        if name not in FAMILIES[family].kernels:
            patch.skipped[name] = f"{family}: {FAMILIES[family].eager[name]} (eager)"
            continue
        patcher = _PATCHERS[name]
        if name == "lora_nf4":  # the one kernel that reads the checkpointing state
            patcher = functools.partial(_patch_lora_nf4, checkpoint_pass=checkpoint_pass)
        result = patcher(base, family, patch)
        if isinstance(result, str):
            patch.skipped[name] = result
        else:
            patch.applied.append(name)
            patch.modules[name] = result
    log.info(
        "kernels (%s, family %s, %s): applied %s; skipped %s",
        selection,
        family,
        device_type,
        patch.modules or "none",
        patch.skipped or "none",
    )
    return patch


# ---- instance patching ---------------------------------------------------------------------------


def _replace_forward(module: torch.nn.Module, impl: Callable, patch: KernelPatch, **static) -> None:
    """Give `module` an instance forward `impl(module, original_forward, *args, **static, **kwargs)`.

    The new forward holds the module (and its original forward) only weakly. A failed step's traceback
    outlives the step (Prefect keeps an OOM in the failed state while the task retries), and its frames keep
    their functions: with the module in this closure, one OOM kept the whole model on the GPU after cleanup
    (H100, 1B shape: 846 MiB). The patch's undo list holds the module until the patch is dropped.
    """
    # accelerate's hooks live in the instance `forward` and call `_old_forward`: patch under the hook
    attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    had_own = attr in module.__dict__
    previous = module.__dict__.get(attr)
    owner = weakref.ref(module)
    original = _weak_original(module, attr, previous if had_own else None)

    def forward(*args, **kwargs):
        return impl(owner(), original(), *args, **static, **kwargs)

    setattr(module, attr, forward)

    def undo() -> None:
        if had_own:
            setattr(module, attr, previous)
        else:
            delattr(module, attr)

    patch._undo.append(undo)


def _weak_original(module: torch.nn.Module, attr: str, previous: Callable | None) -> Callable[[], Callable]:
    """A getter of the forward `_replace_forward` wraps, holding `module` weakly."""
    if previous is None:
        unbound = getattr(type(module), attr)
        owner = weakref.ref(module)
        return lambda: unbound.__get__(owner())
    if inspect.ismethod(previous) and previous.__self__ is module:
        return weakref.WeakMethod(previous)  # accelerate's `_old_forward`: the module's own forward
    return lambda: previous  # an earlier instance forward (it holds what it holds)


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
        _replace_forward(mod, impl, patch, gemma=FAMILIES[family].norm_offset == 1.0)
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
            _replace_forward(mod, impl, patch)
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
            _replace_forward(mod, impl, patch, activation=act)
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

    _replace_forward(base, impl, patch)
    return 1


def _patch_lora_nf4(
    base: torch.nn.Module,
    family: str,
    patch: KernelPatch,
    checkpoint_pass: Callable[[], str | None] = _no_pass,
) -> int | str:
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except ImportError:
        return "peft with bitsandbytes support is not installed"
    from .lora_linear import adapters_in, lora_nf4_linear

    casts = _AdapterCasts()
    casts_ref = weakref.ref(casts)  # the patch holds the casts; a kept traceback's frames (these closures) do not

    def impl(mod, original, x, *args, layer_output: bool, **kwargs):
        name = mod.active_adapters[0] if len(mod.active_adapters) == 1 else None
        fast = (
            not args
            and not kwargs
            and name is not None
            and not mod.disable_adapters
            and not mod.merged
            and name in mod.lora_A
            and name not in getattr(mod, "lora_variant", {})
        )
        if fast:
            drop = mod.lora_dropout[name]
            fast = isinstance(drop, torch.nn.Identity) or drop.p == 0 or not drop.training
        if not fast:  # few tokens, DoRA, dropout, mixed adapters, merged: peft's own forward is right there
            return original(x, *args, **kwargs)
        layer = mod.base_layer
        dtype = getattr(layer, "compute_dtype", None) or x.dtype
        lora_a, lora_b = mod.lora_A[name].weight, mod.lora_B[name].weight
        phase = checkpoint_pass()
        again = phase == "recompute"
        keep = phase == "first"  # the first pass of an "unsloth" checkpointed layer keeps its casts for the recompute
        # a recompute captured in a CUDA graph casts for itself: a replay would read this step's casts next step
        captured = again and x.is_cuda and torch.cuda.is_current_stream_capturing()
        state = None if captured else casts_ref()
        ab = state.take(mod, name, dtype, keep, again) if state is not None else None
        if ab is None:
            ab = adapters_in(lora_a, lora_b, dtype)
            if keep and state is not None:
                state.put(mod, name, ab)
        weight = layer.weight
        y = lora_nf4_linear(
            x if x.dtype == dtype else x.to(dtype),
            # the plain tensor under bitsandbytes' Params4bit: each use of the subclass (a dtype, a data_ptr,
            # a view) runs its Python __torch_function__, ~100 times per decoder layer per step
            weight.data,
            weight.quant_state,
            layer.bias,
            lora_a,
            lora_b,
            mod.scaling[name],
            compute_output=not (layer_output and again),
            casts=ab,
        )
        return y if y.dtype == x.dtype else y.to(x.dtype)  # each skipped no-op `.to` is one aten dispatch less

    # The projection whose output is only added to the residual stream: in a checkpointing recompute
    # nothing reads it, so it is not computed (None where a post-norm reads it, e.g. Gemma 2).
    layer_output = FAMILIES[family].layer_output if family in FAMILIES else None
    count = 0
    for path, mod in base.named_modules():
        if isinstance(mod, LoraLinear4bit):
            qs = getattr(mod.base_layer.weight, "quant_state", None)
            if qs is not None and qs.quant_type == "nf4":
                last = layer_output is not None and path.endswith(layer_output)
                _replace_forward(mod, impl, patch, layer_output=last)
                casts.modules.append(weakref.ref(mod))
                count += 1
    if count:
        patch._undo.append(casts.drop)  # the patch owns the casts; the forwards reach them weakly

        def refreshing(mod, original, *args, **kwargs):
            state = casts_ref()
            if state is None:
                return original(*args, **kwargs)
            state.refresh()
            try:
                return original(*args, **kwargs)
            finally:
                state.settle()

        # not a forward hook: with hooks, Module.__call__ runs the forward from a closure over the module, which
        # a kept OOM traceback would keep alive with the whole model (test_gpu_flow's OOM recovery)
        _replace_forward(base, refreshing, patch)
    return count or "no peft LoRA layers over bitsandbytes NF4 weights"


class _AdapterCasts:
    """Every patched projection's adapters cast to its compute dtype at the start of each model forward, in
    one multi-tensor copy (4 launches for the 224 adapters of a 1B model) where casting per projection took
    one launch per adapter, 224 of ~3,000 launches of a 1B step (benchmarks/profile_step.py launch sources).

    Cast afresh every forward: an optimizer step in between is never missed, even one that does not bump the
    adapters' versions (fused AdamW does not). A projection takes its casts once; the first pass of an
    "unsloth" checkpointed layer keeps them for its recompute in backward, which takes them then. What the
    forward did not take is dropped when it returns, so no cast outlives the step.
    """

    def __init__(self) -> None:
        self.modules: list[weakref.ReferenceType[torch.nn.Module]] = []
        self.casts: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
        self.kept: set[int] = set()
        self.inside = False  # within a forward of the model: what refresh cast is current

    def refresh(self) -> None:
        """At the model's forward: cast every projection's active adapter."""
        from .lora_linear import adapters_in_bulk

        groups: dict[torch.dtype, list[tuple[int, str, torch.Tensor, torch.Tensor]]] = {}
        for ref in self.modules:
            mod = ref()
            dtype = getattr(getattr(mod, "base_layer", None), "compute_dtype", None)
            if dtype is None or len(mod.active_adapters) != 1 or mod.active_adapters[0] not in mod.lora_A:
                continue  # the projection casts for itself, if it takes the fast path at all
            name = mod.active_adapters[0]
            groups.setdefault(dtype, []).append((id(mod), name, mod.lora_A[name].weight, mod.lora_B[name].weight))
        self.casts, self.kept, self.inside = {}, set(), True
        for dtype, items in groups.items():
            made = adapters_in_bulk([(a, b) for _, _, a, b in items], dtype)
            self.casts.update((key, (name, a, b)) for (key, name, _, _), (a, b) in zip(items, made, strict=True))

    def settle(self) -> None:
        """When the model's forward returns: keep only the casts a recompute will take."""
        self.casts = {key: entry for key, entry in self.casts.items() if key in self.kept}
        self.inside = False

    def drop(self) -> None:
        self.casts, self.kept, self.inside = {}, set(), False

    def take(
        self, mod: torch.nn.Module, name: str, dtype: torch.dtype, keep: bool, recompute: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`mod`'s casts, or None: none current (a call outside the model's forward), another adapter or dtype."""
        if not (self.inside or recompute):
            return None
        entry = self.casts.get(id(mod)) if keep else self.casts.pop(id(mod), None)
        if entry is None or entry[0] != name or entry[1].dtype != dtype:
            return None
        if keep:
            self.kept.add(id(mod))
        return entry[1], entry[2]

    def put(self, mod: torch.nn.Module, name: str, ab: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A first pass's own casts, for its recompute."""
        self.casts[id(mod)] = (name, *ab)
        self.kept.add(id(mod))


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
    gpu = emb.weight.device
    try:
        host = to_host(emb.weight.detach())
        # A probe before the GPU copy goes: pinned memory may be refused (locked-memory limits), or the
        # GPU may not reach it (no unified addressing); either way the table then stays where it is.
        probe = gather_rows(host, torch.zeros(1, dtype=torch.long, device=gpu))
        if not torch.equal(probe[0], emb.weight[0].detach()):
            return "the GPU read a different row 0 from the host table than the model has"
    except Exception as err:
        return f"host table not usable from {gpu}: {type(err).__name__}: {str(err).splitlines()[0]}"
    emb.weight = torch.nn.Parameter(host, requires_grad=False)  # the GPU copy is freed here

    def impl(mod, original, input_ids):
        return gather_rows(mod.weight, input_ids)

    _replace_forward(emb, impl, patch)

    def back_to_device() -> None:
        emb.weight = torch.nn.Parameter(emb.weight.detach().to(gpu), requires_grad=False)

    patch._undo.append(back_to_device)
    return 1


_PATCHERS: dict[str, Callable[[torch.nn.Module, str, KernelPatch], int | str]] = {
    "rms_norm": _patch_rms_norm,
    "rope": _patch_rope,
    "swiglu": _patch_swiglu,
    "geglu": _patch_geglu,
    "fused_linear_ce": _patch_fused_ce,
    "lora_nf4": _patch_lora_nf4,
    "host_embedding": _patch_host_embedding,
}
