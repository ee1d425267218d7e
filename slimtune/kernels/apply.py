"""Select kernels for a loaded model and swap them into its module instances, reversibly.

Patching is per instance and undone by `KernelPatch.undo()` (`instance_patch`); which modules each
kernel replaces is decided by explicit type checks per model family (`patchers`, `lora_nf4_patch`).

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
import logging
from collections.abc import Callable

import torch

from slimtune.models.families import FAMILIES, KERNEL_NAMES

from ._launch import compute_device, interpreter_on
from .instance_patch import KernelPatch
from .lora_nf4_patch import no_checkpoint_pass, patch_lora_nf4
from .patchers import PATCHERS

log = logging.getLogger("slimtune.kernels")

# KERNEL_NAMES, and which kernels match which family's math (and why the others stay eager), are in
# slimtune.models.families.


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


def apply_kernels(
    model: torch.nn.Module,
    selection: str | list[str] = "auto",
    exclude: dict[str, str] | None = None,
    *,
    checkpoint_pass: Callable[[], str | None] = no_checkpoint_pass,
) -> KernelPatch:
    """Swap Triton kernels into `model` (a transformers causal LM, optionally wrapped by peft).

    `exclude` maps kernel names the caller cannot use to the reason, reported in `skipped`.
    `checkpoint_pass` says, at call time, which pass of an "unsloth"-checkpointed layer runs (the model's
    `slimtune.train.step.LayerPass`): in "recompute" lora_nf4 skips the output nobody reads, in
    "first" it keeps its adapters' casts for that recompute. Passed in rather than imported, so the kernels do not
    depend on the checkpointing code.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    family = getattr(config, "model_type", None)
    device_type = compute_device(model).type
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
        patcher = PATCHERS[name]
        if name == "lora_nf4":  # the one kernel that reads the checkpointing state
            patcher = functools.partial(patch_lora_nf4, checkpoint_pass=checkpoint_pass)
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
