"""What the mmproj tests of every multimodal family share: the tiny checkpoint's random vision tower, saving it with
its image processor's mean and std, copies of it changed, its (text GGUF, mmproj) pair, the export task writing and
verifying both, seeded images, pixels normalized as the processor does, and llama.cpp's image embeddings held
against transformers'."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from slimtune.export import convert_hf_to_gguf
from slimtune.export.gguf_mmproj import convert_mmproj_to_gguf, llama_cpp_image_embeddings, mmproj_file_name
from slimtune.spec.schema import parse_spec
from slimtune.tasks.gguf_convert_and_push import gguf_convert_and_push


def randomize_tower(
    model: torch.nn.Module,
    generator: torch.Generator,
    rule: Callable[[str, torch.Tensor, torch.Generator], torch.Tensor | None],
    *,
    buffers: bool = False,
    skip: tuple[str, ...] = (),
) -> None:
    """Every parameter of `model` (and buffer, with `buffers`) outside the language model, lm_head and names holding
    one of `skip` set from standard normal noise drawn from `generator` in turn: `rule(name, noise, generator)`, or
    where that is None the noise over the square root of the fan-in, which keeps activations about unit-sized. A tower
    at its init (zero biases, unit norms) would let mistakes that only move those go unseen."""
    tensors = [*model.named_parameters(), *(model.named_buffers() if buffers else [])]
    with torch.no_grad():
        for name, tensor in tensors:
            if any(part in name for part in ("language_model", "lm_head", *skip)):
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            value = rule(name, noise, generator)
            tensor.copy_(noise / max(1, tensor[0].numel()) ** 0.5 if value is None else value)


def save_checkpoint(model, tokenizer, out: Path, mean: list[float], std: list[float], **processor) -> Path:
    """`model` and `tokenizer` saved as transformers saves them, with a preprocessor_config.json of `mean`/`std` (and
    `processor`'s other fields)."""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({"image_mean": mean, "image_std": std, **processor}))
    return out


def copy_checkpoint(
    checkpoint: Path,
    out: Path,
    change: Callable[[str, torch.Tensor], torch.Tensor] = lambda key, tensor: tensor,
    preprocessor: bool | dict = True,
) -> Path:
    """The checkpoint under `out`, its tensors through `change`; its preprocessor_config.json copied (True), left out
    (False) or replaced by `preprocessor` (a dict)."""
    out.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix != ".safetensors" and (preprocessor is True or f.name != "preprocessor_config.json"):
            shutil.copy(f, out / f.name)
    if isinstance(preprocessor, dict):
        (out / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    tensors = {k: change(k, t) for k, t in load_file(checkpoint / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def exported_mmproj_check(checkpoint: Path, tmp_path: Path) -> dict:
    """The export task (f16, verify) on `checkpoint`, standing in for merged/ (the merge copies the vision weights and
    the tokenizer as stored): the text GGUF and the mmproj are written beside each other; the mmproj's verification."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    spec = parse_spec(
        {
            "name": "r",
            "model": {"name_or_path": str(checkpoint), "device": "cpu"},
            "data": {"path": str(data)},
            "output_dir": str(tmp_path / "out"),
            "export": {"gguf": ["f16"], "verify": True},
        }
    )
    summary = {"spec": spec.model_dump(mode="json"), "train": {"steps": 1}}
    result = gguf_convert_and_push(spec, checkpoint, tmp_path / "adapter", summary).to_dict()
    folder = tmp_path / "out" / "r" / "gguf"
    assert sorted(p.name for p in folder.glob("*.gguf")) == ["r-f16.gguf", "r-mmproj-f16.gguf"]
    return result["mmproj"]["verification"]


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


def embedding_gap(ours: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(largest difference, largest reference value) of two image embeddings."""
    return float(np.abs(ours - reference).max()), float(np.abs(reference).max())


def assert_embeddings_match(
    ggufs: tuple[Path, Path],
    reference: Callable[[np.ndarray], np.ndarray],
    height: int,
    width: int,
    tokens: int,
    bound: float,
) -> None:
    """llama.cpp's embeddings of a seeded `height` x `width` image from `ggufs` (text GGUF, mmproj): `tokens` rows in
    the tiny language models' width (256), within `bound` of the largest of `reference`'s (transformers') for the
    same image, and more than 0.1 of it off those of another image (the control: a close match means something)."""
    text, mmproj = ggufs
    ours = llama_cpp_image_embeddings(text, mmproj, random_image(0, height, width))
    expected = reference(random_image(0, height, width))
    assert ours.shape == expected.shape == (tokens, 256), (ours.shape, expected.shape)
    diff, scale = embedding_gap(ours, expected)
    assert 0 < diff < bound * scale, (diff, scale)
    control, _ = embedding_gap(ours, reference(random_image(1, height, width)))
    assert control > 0.1 * scale, (control, scale)
