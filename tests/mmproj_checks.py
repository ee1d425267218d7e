"""What the mmproj tests of every multimodal family share: saving the tiny checkpoint with its image processor's
mean and std, its (text GGUF, mmproj) pair, seeded images, and pixels normalized as the processor does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from slimtune.export import convert_hf_to_gguf
from slimtune.export.gguf_mmproj import convert_mmproj_to_gguf, mmproj_file_name


def save_checkpoint(model, tokenizer, out: Path, mean: list[float], std: list[float], **processor) -> Path:
    """`model` and `tokenizer` saved as transformers saves them, with a preprocessor_config.json of `mean`/`std` (and
    `processor`'s other fields)."""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({"image_mean": mean, "image_std": std, **processor}))
    return out


def text_and_mmproj(checkpoint: Path, out: Path) -> tuple[Path, Path]:
    """(text f16 GGUF, mmproj) of `checkpoint`, written under `out`."""
    [text] = convert_hf_to_gguf(checkpoint, out / "mm-f16.gguf", "f16")
    return text, convert_mmproj_to_gguf(checkpoint, out / mmproj_file_name("mm"), name="mm")


def random_image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def normalized(rgb: np.ndarray, mean: list[float], std: list[float]) -> torch.Tensor:
    """(1, 3, H, W) pixels as the image processor makes them (to [0, 1], then `mean` and `std`), computed here, not
    through the module under test."""
    pixels = torch.from_numpy(rgb.astype(np.float32)).permute(2, 0, 1)[None] / 255.0
    return (pixels - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
