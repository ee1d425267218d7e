"""The module names LoRA adapts in a family: the spec's `lora.target_modules` as peft and NF4Experts take them.

The spec names the seven projections of a dense decoder (q/k/v/o, gate/up/down); a family may fuse some (Phi-3's
qkv_proj), have more (Qwen3.5's linear-attention projections, trained wherever attention's are), or hold the MLP
in its experts (Qwen3-MoE: `slimtune.kernels.nf4_experts` takes that LoRA, not peft).
"""

from __future__ import annotations

from slimtune.models.experts import HELD
from slimtune.models.families import ATTENTION, FAMILIES, Family


def lora_target_modules(model_type: str, requested: list[str] | str) -> list[str] | str:
    """The family's module names for `lora.target_modules` that peft adapts: q/k/v become qkv_proj where they
    are fused; an MoE's MLP projections are left to `expert_lora_targets`.

    Raises:
        ValueError: a fused family asked for only part of a fused projection (e.g. q_proj alone in Phi-3).
    """
    family = FAMILIES.get(model_type)
    if family is None or isinstance(requested, str):
        return requested
    requested = _with_linear_attention(family, requested)
    if family.experts:
        expert_lora_targets(model_type, requested)  # refuses half of a fused expert projection
        requested = [t for t in requested if not any(t in names for names in HELD.values())]
    if not family.fused:
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


def expert_lora_targets(model_type: str, requested: list[str] | str) -> list[str]:
    """The expert projections of an MoE family that `requested` adapts ("gate_up", "down"); [] for dense ones.

    Raises:
        ValueError: gate_proj without up_proj or the reverse (each expert's gate and up are one tensor).
    """
    family = FAMILIES.get(model_type)
    if family is None or not family.experts:
        return []
    if isinstance(requested, str):  # all-linear: the experts are linears too
        return list(HELD)
    out = []
    for projection, names in HELD.items():
        asked = [n for n in names if n in requested]
        if asked and len(asked) < len(names):
            missing = [n for n in names if n not in requested]
            raise ValueError(
                f"lora.target_modules: {model_type} holds each expert's {', '.join(names)} in one tensor; list "
                f"all of them (missing {', '.join(missing)})"
            )
        if asked:
            out.append(projection)
    return out


def canonical_targets(model_type: str, targets: list[str]) -> list[str]:
    """The separate projections behind `targets` (qkv_proj -> q_proj, k_proj, v_proj), for shape arithmetic."""
    family = FAMILIES.get(model_type)
    fused = family.fused if family else {}
    targets = _with_linear_attention(family, targets) if family else targets
    return list(dict.fromkeys(p for t in targets for p in fused.get(t, (t,))))


def _with_linear_attention(family: Family, requested: list[str]) -> list[str]:
    """`requested` plus the linear-attention layers' projections where it names an attention projection."""
    if not family.linear_attention_targets or not set(requested) & set(ATTENTION):
        return requested
    return list(dict.fromkeys([*requested, *family.linear_attention_targets]))
