"""Reading a saved checkpoint's tensors back, for tests that compare checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `model_dir`, by name."""
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out
