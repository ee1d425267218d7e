"""llama.cpp's vision projector GGUF (`mmproj`) for Qwen3.5 checkpoints (projector "qwen3vl_merger"), run in mtmd.

A tiny Qwen3.5: the pretrained tiny qwen3_5_text as its language model and a random two-layer vision tower of 8 px
patches on an 8 x 8 position grid, merged 2 x 2, so that the two-frame patch kernel (two kernels in the file), the
learned positions (resampled for a 48 x 64 image), the 2D rope, the merger's LayerNorm and GELU MLP all take part.
The image processor's mean and std are not the defaults.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from mmproj_checks import (
    assert_embeddings_match,
    copy_checkpoint,
    embedding_gap,
    exported_mmproj_check,
    random_image,
    randomize_tower,
    save_checkpoint,
    text_and_mmproj,
)
from safetensors.torch import load_file, save_file

from slimtune.export.gguf_header import read_header
from slimtune.export.gguf_mmproj import convert_mmproj_to_gguf, llama_cpp_image_embeddings
from slimtune.models.tiny import ensure_pretrained

PATCH = 8
MEAN, STD = [0.47, 0.45, 0.42], [0.25, 0.27, 0.29]
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": PATCH,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,  # an 8 x 8 grid: 64 px images at their own positions
    "out_hidden_size": 256,  # the tiny language model's hidden size
}
# Measured 6.7e-4 to 1.23e-3 of the largest (up to 3.2) over 20 images of 5 shapes (8 to 36 tokens, the positions
# resampled or not), 4.6e-4 to 8.8e-4 with every weight f32 in the file: ggml's own rounding on the CPU and the f16
# matrices (ggml's GELU is the tanh one, the merger's in transformers the erf one: under 1e-4 of it). 2e-3 of the
# largest leaves 1.6x.
BOUND = 2e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Qwen3.5 checkpoint, saved as transformers saves it."""
    out = tmp_path_factory.mktemp("qwen35mm") / "base"
    text_dir = ensure_pretrained("qwen3_5_text")
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    config = transformers.AutoConfig.for_model(
        "qwen3_5",
        text_config={**text.config.to_dict(), "pad_token_id": tokenizer.pad_token_id},
        vision_config=VISION,
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.tie_word_embeddings = False
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    randomize_tower(model, torch.Generator().manual_seed(0), _vision_weight)
    return save_checkpoint(model, tokenizer, out, MEAN, STD)


def _vision_weight(name: str, noise: torch.Tensor, _: torch.Generator) -> torch.Tensor | None:
    """The tensors randomize_tower's fan-in scaling does not fit: LayerNorm scales near 1, biases of 0.1."""
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.2 * noise
    return 0.1 * noise if noise.dim() == 1 else None


@pytest.fixture(scope="module")
def ggufs(checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(text f16 GGUF, mmproj) of the checkpoint."""
    return text_and_mmproj(checkpoint, tmp_path_factory.mktemp("ggufs"))


def _transformers_embeddings(checkpoint: Path, rgb: np.ndarray) -> np.ndarray:
    """What the language model receives for the image in transformers: Qwen2VLImageProcessor's patches (not resized,
    normalized with MEAN and STD) through get_image_features, not through the module under test."""
    processor = transformers.Qwen2VLImageProcessorPil(do_resize=False, image_mean=MEAN, image_std=STD, patch_size=PATCH)
    inputs = processor(images=rgb, return_tensors="pt")
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        features = model.get_image_features(inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    return features.pooler_output[0].numpy()


@pytest.mark.parametrize(("height", "width", "tokens"), [(64, 64, 4 * 4), (48, 64, 3 * 4)])
def test_llama_cpp_image_embeddings_match_transformers(checkpoint, ggufs, height, width, tokens):
    pytest.importorskip("llama_cpp")
    # merged 2 x 2 patches; 48 x 64 (3 rows of 4) resamples the 8 x 8 positions and fixes which way the rows run
    assert_embeddings_match(ggufs, partial(_transformers_embeddings, checkpoint), height, width, tokens, BOUND)


def _one_frame(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The patch kernel's first frame in both (a file holding it twice comes out of the writer as this)."""
    if not key.endswith("patch_embed.proj.weight"):
        return tensor
    return tensor[:, :, :1].expand(tensor.shape).contiguous()


# The mistakes the check exists for, each a file the writer makes from a changed checkpoint, compared with the
# transformers embeddings of the original: the image processor's mean and std left out (CLIP's defaults instead),
# and one frame of the patch kernel written for both
_MISTAKES = {"default_mean_std": {"preprocessor": False}, "one_frame": {"change": _one_frame}}


@pytest.mark.parametrize("mistake", sorted(_MISTAKES))
def test_the_check_catches_a_wrong_mmproj(checkpoint, ggufs, tmp_path, mistake):
    pytest.importorskip("llama_cpp")
    text, _ = ggufs
    wrong = convert_mmproj_to_gguf(
        copy_checkpoint(checkpoint, tmp_path / "base", **_MISTAKES[mistake]), tmp_path / "w.gguf"
    )
    ours = llama_cpp_image_embeddings(text, wrong, random_image(0, 48, 64))
    diff, scale = embedding_gap(ours, _transformers_embeddings(checkpoint, random_image(0, 48, 64)))
    # measured 0.074 of the largest with CLIP's mean and std, 0.81 with the first frame twice
    assert diff > BOUND * scale, (diff, scale)


def test_mmproj_holds_llama_cpps_qwen3vl_keys_and_tensors(checkpoint, ggufs):
    _, mmproj = ggufs
    kv = read_header(mmproj).kv
    vision = gguf.Keys.ClipVision
    assert kv[gguf.Keys.General.ARCHITECTURE] == "clip" and kv[gguf.Keys.General.TYPE] == "mmproj"
    assert kv[gguf.Keys.Clip.PROJECTOR_TYPE] == gguf.VisionProjectorType.QWEN3VL == "qwen3vl_merger"
    assert kv[vision.USE_GELU] is True and kv[vision.SPATIAL_MERGE_SIZE] == 2
    assert kv[vision.PROJECTION_DIM] == 256 and kv[vision.EMBEDDING_LENGTH] == 32 and kv[vision.BLOCK_COUNT] == 2
    assert kv[vision.IMAGE_SIZE] == 8 * PATCH and kv[vision.PATCH_SIZE] == PATCH  # the 8 x 8 position grid
    assert kv[vision.Attention.LAYERNORM_EPS] == pytest.approx(1e-6)
    assert kv[vision.IMAGE_MEAN] == pytest.approx(MEAN) and kv[vision.IMAGE_STD] == pytest.approx(STD)
    tensors = {t.name: t for t in gguf.GGUFReader(mmproj).tensors}
    layer = ["ln1", "ln2", "attn_qkv", "attn_out", "ffn_up", "ffn_down"]
    names = {f"v.blk.{i}.{n}.{p}" for i in range(2) for n in layer for p in ("weight", "bias")}
    names |= {f"{n}.{p}" for n in ("v.post_ln", "mm.0", "mm.2") for p in ("weight", "bias")}
    names |= {"v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight"}
    assert set(tensors) == names
    Q = gguf.GGMLQuantizationType
    assert {tensors[n].tensor_type for n in ("v.patch_embd.weight.1", "mm.0.weight", "v.blk.1.attn_qkv.weight")} == {
        Q.F16
    }
    # the position table f32, unlike the converter's (mmproj_families says why)
    assert {tensors[n].tensor_type for n in ("v.position_embd.weight", "v.post_ln.weight", "mm.2.bias")} == {Q.F32}
    # the Conv3d kernel's two frames, each a 2D kernel (ggml's dimensions reversed)
    kernel = load_file(checkpoint / "model.safetensors")["model.visual.patch_embed.proj.weight"].half()
    for name, frame in (("v.patch_embd.weight", 0), ("v.patch_embd.weight.1", 1)):
        assert tuple(tensors[name].shape) == (PATCH, PATCH, 3, 32)
        np.testing.assert_array_equal(tensors[name].data, kernel[:, :, frame].numpy())


def test_multi_token_prediction_weights_are_left_out(checkpoint, ggufs, tmp_path):
    """The released checkpoints' `mtp.*` (the language model's) change nothing in the file."""
    other = copy_checkpoint(checkpoint, tmp_path / "base")
    tensors = {**load_file(other / "model.safetensors"), "mtp.fc.weight": torch.randn(256, 512)}
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    path = convert_mmproj_to_gguf(other, tmp_path / "mm.gguf", name="mm")
    assert path.read_bytes() == ggufs[1].read_bytes()


def test_a_vision_config_llama_cpp_runs_otherwise_is_refused_with_every_reason(checkpoint, tmp_path):
    base = copy_checkpoint(checkpoint, tmp_path / "base")
    config = json.loads((base / "config.json").read_text())
    vision = {
        **config["vision_config"],
        "spatial_merge_size": 4,
        "hidden_act": "silu",
        "num_position_embeddings": 60,
        "out_hidden_size": 128,
    }
    (base / "config.json").write_text(json.dumps({**config, "vision_config": vision}))
    with pytest.raises(ValueError) as err:
        convert_mmproj_to_gguf(base, tmp_path / "x.gguf")
    message = str(err.value)  # every problem in one message
    assert "llama.cpp cannot run this qwen3_5 vision tower as transformers does" in message
    assert "spatial_merge_size 4 (llama.cpp's qwen3vl graph merges 2 x 2)" in message
    assert "hidden_act 'silu'" in message and "num_position_embeddings 60 is not a square" in message
    assert "out_hidden_size 128 is not the text hidden_size 256" in message
    assert not list(tmp_path.glob("*.gguf"))


def test_export_writes_and_verifies_the_mmproj_beside_the_qwen35_gguf(checkpoint, tmp_path):
    pytest.importorskip("llama_cpp")
    check = exported_mmproj_check(checkpoint, tmp_path)
    # 64 px, the position grid's own size: 4 x 4 merged tokens
    assert check["tokens"] == 16 and check["non_finite_tokens"] == 0, check
    assert 0 < check["max_abs_diff"] < BOUND * check["max_abs_embedding"], check
