"""The lora_nf4 patcher: peft's LoRA layers over bitsandbytes NF4 weights run one fused kernel
(`lora_linear`), their adapters cast once per model forward (`_AdapterCasts`), and the pass of a
checkpointed layer read at call time (`checkpoint_pass`), so a recompute skips the output nobody reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from slimtune.models.families import FAMILIES

from .instance_patch import KernelPatch, replace_forward


def no_checkpoint_pass() -> None:
    """No checkpointing: no pass of a checkpointed layer is ever running."""


def patch_lora_nf4(
    base: torch.nn.Module,
    family: str,
    patch: KernelPatch,
    checkpoint_pass: Callable[[], str | None] = no_checkpoint_pass,
) -> int | str:
    """Route every peft LoRA layer over NF4 weights through the fused kernel; `checkpoint_pass` as `apply_kernels`'s."""
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
                replace_forward(mod, impl, patch, layer_output=last)
                casts.modules.append(weakref.ref(mod))
                count += 1
    if count:
        patch.on_undo(casts.drop)  # the patch owns the casts; the forwards reach them weakly

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
        replace_forward(base, refreshing, patch)
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
