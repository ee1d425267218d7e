"""Read a peft LoRA adapter as per-tensor low-rank factors and check it against the base before any work.

peft saves `base_model.model.<module>.lora_A.weight` / `lora_B.weight` (and `lora_embedding_A/B` for
embeddings); `modules_to_save` copies are saved under the plain `base_model.model.<module>.weight` name and
replace the base tensor outright.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import AdapterMismatchError
from .safetensors_io import TensorEntry

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>embedding_)?(?P<ab>[AB])(?:\.[^.]+)?(?:\.weight)?$")


@dataclass(frozen=True)
class LoraFactor:
    """W_merged = W + scale * (B @ A), transposed for embeddings and `fan_in_fan_out` (Conv1D) layers. A and B may
    carry a leading expert dimension ([E, r, in], [E, out, r]) for a stack of expert matrices
    (`slimtune.merge.fused_experts`); the delta is then one product per expert."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    transpose: bool

    @property
    def shape(self) -> tuple[int, ...]:
        rows, cols, experts = self.b.shape[-2], self.a.shape[-1], tuple(self.b.shape[:-2])
        return (*experts, cols, rows) if self.transpose else (*experts, rows, cols)

    def delta(self, device: torch.device | str) -> torch.Tensor:
        """The fp32 delta on `device`, computed as peft does: (B @ A) * scale."""
        d = self.b.to(device, torch.float32) @ self.a.to(device, torch.float32)
        if self.transpose:
            d = d.transpose(-2, -1).contiguous()
        return d.mul_(self.scale)


@dataclass
class Adapter:
    """LoRA factors and full replacements, keyed by the base checkpoint's tensor names."""

    lora: dict[str, LoraFactor] = field(default_factory=dict)
    replacements: dict[str, torch.Tensor] = field(default_factory=dict)

    def renamed(self, names: dict[str, str]) -> Adapter:
        """The same tensors under the checkpoint's keys, where `names` maps the trained model's names to them (a
        multimodal checkpoint's language model, trained alone); other names are kept."""
        return Adapter(
            {names.get(k, k): f for k, f in self.lora.items()},
            {names.get(k, k): t for k, t in self.replacements.items()},
        )


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    # peft matches a pattern against the module name's dotted suffix (e.g. "q_proj" or "layers.0.q_proj")
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
            return value
    return default


def load_adapter(adapter_dir: Path) -> Adapter:
    """Load the adapter's factors (kept in their saved dtype, moved to fp32 when used) and its scalings."""
    missing = [n for n in ADAPTER_FILES if not (adapter_dir / n).is_file()]
    if missing:
        raise AdapterMismatchError(
            f"adapter dir {adapter_dir} lacks {', '.join(missing)}; pass the "
            "directory written by peft's save_pretrained"
        )
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterMismatchError(
            f"{adapter_dir}/adapter_config.json: peft_type {cfg.get('peft_type')!r} "
            "cannot be merged here; only LoRA adapters are supported"
        )
    if cfg.get("use_dora") or cfg.get("lora_bias"):
        raise AdapterMismatchError(
            f"{adapter_dir}/adapter_config.json: DoRA and lora_bias adapters are not "
            "supported by this merge; train with use_dora=false, lora_bias=false"
        )
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, bool] = {}
    adapter = Adapter()
    for key, value in tensors.items():
        name = key.removeprefix(_PREFIX)
        m = _LORA_KEY.match(name)
        if m:
            halves.setdefault(m["module"], {})[m["ab"]] = value
            kinds[m["module"]] = bool(m["kind"])
        elif ".lora_" in name or not name.endswith((".weight", ".bias")):
            raise AdapterMismatchError(
                f"{adapter_dir}/adapter_model.safetensors: tensor {key!r} is neither "
                "a LoRA factor nor a modules_to_save copy; this merge cannot apply it"
            )
        else:
            adapter.replacements[name] = value
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterMismatchError(
                f"{adapter_dir}: {module} has lora_{next(iter(ab))} but not its partner; the adapter file is incomplete"
            )
        rank = ab["A"].shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        transpose = kinds[module] or bool(cfg.get("fan_in_fan_out"))
        adapter.lora[f"{module}.weight"] = LoraFactor(ab["A"], ab["B"], float(scale), transpose)
    return adapter


def check_against_base(adapter: Adapter, base: dict[str, TensorEntry]) -> None:
    """Raise one error listing every adapter tensor the base lacks or whose shape disagrees."""
    problems = []
    for name, f in adapter.lora.items():
        entry = base.get(name)
        if entry is None:
            problems.append(f"LoRA targets {name} but the base checkpoint has no such tensor")
        elif entry.shape != f.shape:
            problems.append(
                f"{name}: base shape {tuple(entry.shape)} but the LoRA delta is {f.shape} "
                f"(lora_B {tuple(f.b.shape)} @ lora_A {tuple(f.a.shape)})"
            )
    for name, t in adapter.replacements.items():
        entry = base.get(name)
        if entry is None:
            problems.append(f"modules_to_save copy {name} has no tensor of that name in the base checkpoint")
        elif entry.shape != tuple(t.shape):
            problems.append(f"{name}: base shape {tuple(entry.shape)} but the adapter's copy is {tuple(t.shape)}")
    if problems:
        raise AdapterMismatchError(
            "the adapter does not fit this base model (was it trained on another model?):\n  " + "\n  ".join(problems)
        )
