"""llama.cpp's vision projector GGUF (`mmproj`) for Gemma 4 checkpoints (projector "gemma4v"), run in mtmd.

A tiny Gemma 4: the pretrained tiny gemma4_text as its language model and a random two-layer vision encoder of 8 px
patches pooled 2 x 2, with clipped linears whose bounds bite and the standardization on, so that the patch linear
(a convolution kernel in the file), the x / y position tables, the 2D rope, the q / k / v norms, the four RMSNorms
of each layer, the gated FFN, the pooling, the standardization and the embedder all take part. The image processor
normalizes with a mean and std that are not its defaults (it does not normalize by default).
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
from slimtune.export.mmproj_families import MMPROJ_FAMILIES
from slimtune.models.tiny import ensure_pretrained

PATCH, POOL = 8, 2
MEAN, STD = [0.47, 0.45, 0.42], [0.25, 0.27, 0.29]
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": PATCH,
    "pooling_kernel_size": POOL,
    "position_embedding_size": 32,  # patches per side at most
    "use_clipped_linears": True,
    "standardize": True,
}
# Measured 1.5e-3 to 2.7e-3 of the largest (up to 4.7) over 20 images of 5 shapes (77 to 144 tokens), 1.3e-3 to
# 2.1e-3 with every weight f32 in the file and about as much with flash attention off, the clipping and the
# standardization off, or transformers' GELU fed ggml's f16 table: ggml's own computation on the CPU (transformers in
# f32 and f64 differ by 1.5e-6). 5e-3 of the largest leaves 1.9x; the converter's gelu_quick is 0.016 off.
BOUND = 5e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Gemma 4 checkpoint, saved as transformers saves it."""
    out = tmp_path_factory.mktemp("gemma4mm") / "base"
    text_dir = ensure_pretrained("gemma4_text", "gemma")
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    config = transformers.AutoConfig.for_model(
        "gemma4",
        text_config={**text.config.to_dict(), "pad_token_id": tokenizer.pad_token_id},
        vision_config=VISION,
    )
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.tie_word_embeddings = text.config.tie_word_embeddings
    model = transformers.Gemma4ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    # the clipping bounds and the standardization are buffers; the rope's are left as they are
    randomize_tower(model, torch.Generator().manual_seed(0), _vision_weight, buffers=True, skip=("rotary",))
    return save_checkpoint(model, tokenizer, out, MEAN, STD, do_normalize=True)


def _vision_weight(name: str, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """The tensors randomize_tower's fan-in scaling does not fit: RMSNorm scales near 1, the x / y position tables,
    the clipping bounds and the standardization."""
    uniform = torch.rand(noise.shape, generator=generator)  # for every tensor, as when BOUND was measured
    if "norm" in name:
        return 1.0 + 0.2 * noise
    if name.endswith("position_embedding_table"):
        return 0.3 * noise
    if name.endswith(("_max", "_min")):  # clipping bounds that bite: activations are about unit-sized
        return (0.8 + 0.8 * uniform) * (-1 if name.endswith("_min") else 1)
    if name.endswith("std_bias"):  # about the pooled features, which are scaled by sqrt(32)
        return noise
    return 0.5 + uniform if name.endswith("std_scale") else None


@pytest.fixture(scope="module")
def ggufs(checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(text f16 GGUF, mmproj) of the checkpoint."""
    return text_and_mmproj(checkpoint, tmp_path_factory.mktemp("ggufs"))


def _transformers_embeddings(checkpoint: Path, rgb: np.ndarray) -> np.ndarray:
    """What the language model receives for the image in transformers: Gemma4ImageProcessor's patches (not resized,
    normalized with MEAN and STD) through get_image_features, not through the module under test."""
    processor = transformers.Gemma4ImageProcessorPil(
        do_resize=False, do_normalize=True, image_mean=MEAN, image_std=STD, patch_size=PATCH, pooling_kernel_size=POOL
    )
    inputs = processor(images=rgb, return_tensors="pt")
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        features = model.get_image_features(inputs["pixel_values"], image_position_ids=inputs["image_position_ids"])
    return features.pooler_output[0].numpy()


# 144 px: 9 x 9 pooled tokens, the fewest llama.cpp keeps an image at (70); 128 x 160: 8 x 10
@pytest.mark.parametrize(("height", "width", "tokens"), [(144, 144, 9 * 9), (128, 160, 8 * 10)])
def test_llama_cpp_image_embeddings_match_transformers(checkpoint, ggufs, height, width, tokens):
    pytest.importorskip("llama_cpp")
    assert_embeddings_match(ggufs, partial(_transformers_embeddings, checkpoint), height, width, tokens, BOUND)


def _channels_first(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The patch linear's columns as (channel, row, column) (the writer reorders them into this checkpoint's)."""
    if not key.endswith("patch_embedder.input_proj.weight"):
        return tensor
    n = tensor.shape[0]
    return tensor.reshape(n, 3, PATCH, PATCH).permute(0, 2, 3, 1).reshape(n, -1).contiguous()


def _converters_activation(family, monkeypatch) -> None:
    """The family's hparams without clip.use_gelu, as llama.cpp's converter writes them (clip.cpp: gelu_quick)."""
    hparams = family.hparams

    def without_gelu(model_dir, full):
        keys, problems = hparams(model_dir, full)
        return {k: v for k, v in keys.items() if k != gguf.Keys.ClipVision.USE_GELU}, problems

    monkeypatch.setattr(family, "hparams", without_gelu)


# The mistakes the check exists for, each a file the writer makes from a changed checkpoint (or, for the activation,
# the writer told to leave clip.use_gelu out), compared with the transformers embeddings of the original: the image
# processor's mean and std left out (its default: no normalization), the patch linear's columns taken as stored, and
# the converter's gelu_quick in the tower
_MISTAKES = {
    "default_mean_std": {"preprocessor": {}},
    "patch_as_stored": {"change": _channels_first},
    "converters_gelu_quick": {},
}


@pytest.mark.parametrize("mistake", sorted(_MISTAKES))
def test_the_check_catches_a_wrong_mmproj(checkpoint, ggufs, tmp_path, monkeypatch, mistake):
    pytest.importorskip("llama_cpp")
    text, _ = ggufs
    if mistake == "converters_gelu_quick":
        _converters_activation(MMPROJ_FAMILIES["gemma4"], monkeypatch)
    wrong = convert_mmproj_to_gguf(
        copy_checkpoint(checkpoint, tmp_path / "base", **_MISTAKES[mistake]), tmp_path / "w.gguf"
    )
    ours = llama_cpp_image_embeddings(text, wrong, random_image(0, 128, 160))
    diff, scale = embedding_gap(ours, _transformers_embeddings(checkpoint, random_image(0, 128, 160)))
    # measured 1.27 of the largest with no normalization, 1.30 with the columns as stored, 0.016 with gelu_quick
    assert diff > BOUND * scale, (diff, scale)


def test_mmproj_holds_llama_cpps_gemma4v_keys_and_tensors(checkpoint, ggufs):
    _, mmproj = ggufs
    kv = read_header(mmproj).kv
    vision = gguf.Keys.ClipVision
    assert kv[gguf.Keys.General.ARCHITECTURE] == "clip" and kv[gguf.Keys.General.TYPE] == "mmproj"
    assert kv[gguf.Keys.Clip.PROJECTOR_TYPE] == gguf.VisionProjectorType.GEMMA4V == "gemma4v"
    assert kv[vision.USE_GELU] is True and kv[vision.Projector.SCALE_FACTOR] == POOL
    assert kv[vision.PROJECTION_DIM] == 256 and kv[vision.EMBEDDING_LENGTH] == 32 and kv[vision.BLOCK_COUNT] == 2
    assert kv[vision.PATCH_SIZE] == PATCH and kv[vision.Attention.LAYERNORM_EPS] == pytest.approx(1e-6)
    assert kv[vision.IMAGE_MEAN] == pytest.approx(MEAN) and kv[vision.IMAGE_STD] == pytest.approx(STD)
    tensors = {t.name: t for t in gguf.GGUFReader(mmproj).tensors}
    bounds = ("input_min", "input_max", "output_min", "output_max")
    linears = ["attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down"]
    norms = ["ln1", "ln2", "attn_post_norm", "ffn_post_norm", "attn_q_norm", "attn_k_norm"]
    names = {f"v.blk.{i}.{n}.{p}" for i in range(2) for n in linears for p in ("weight", *bounds)}
    names |= {f"v.blk.{i}.{n}.weight" for i in range(2) for n in norms}
    names |= {
        "v.patch_embd.weight",
        "v.position_embd.weight",
        "v.std_bias",
        "v.std_scale",
        "mm.input_projection.weight",
    }
    assert set(tensors) == names
    Q = gguf.GGMLQuantizationType
    assert {tensors[n].tensor_type for n in ("v.patch_embd.weight", "mm.input_projection.weight")} == {Q.F16}
    f32 = ("v.position_embd.weight", "v.std_scale", "v.blk.0.attn_q.input_max", "v.blk.1.attn_post_norm.weight")
    assert {tensors[n].tensor_type for n in f32} == {Q.F32}
    stored = load_file(checkpoint / "model.safetensors")
    layer = "model.vision_tower.encoder.layers.1."
    # a bound as a 1-element tensor where clip.cpp looks for it: beside its linear's weight
    for name, key in (
        ("v.blk.1.ffn_down.output_min", "mlp.down_proj.output_min"),
        ("v.blk.1.attn_k.input_max", "self_attn.k_proj.input_max"),
    ):
        np.testing.assert_array_equal(tensors[name].data, stored[layer + key].reshape(1).numpy())
    # the patch linear over (row, column, channel) as a (channel, row, column) kernel, ggml's dimensions reversed
    proj = stored["model.vision_tower.patch_embedder.input_proj.weight"].half()
    kernel = tensors["v.patch_embd.weight"]
    assert tuple(kernel.shape) == (PATCH, PATCH, 3, 32)
    np.testing.assert_array_equal(kernel.data, proj.reshape(32, PATCH, PATCH, 3).permute(0, 3, 1, 2).numpy())
    # the x and y tables as one (2, positions, width) tensor, which clip.cpp views as two
    table = stored["model.vision_tower.patch_embedder.position_embedding_table"]
    np.testing.assert_array_equal(tensors["v.position_embd.weight"].data, table.numpy())


def test_mean_and_std_only_where_the_image_processor_normalizes(checkpoint, tmp_path):
    """Gemma4ImageProcessor normalizes only when told (do_normalize false by default), whatever mean and std its
    config lists; llama.cpp always normalizes, so the file then holds mean 0 and std 1."""
    listed = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    for n, processor in enumerate((listed, {**listed, "do_normalize": False})):
        path = convert_mmproj_to_gguf(
            copy_checkpoint(checkpoint, tmp_path / f"b{n}", preprocessor=processor), tmp_path / f"{n}.gguf"
        )
        kv = read_header(path).kv
        assert kv[gguf.Keys.ClipVision.IMAGE_MEAN] == [0.0] * 3 and kv[gguf.Keys.ClipVision.IMAGE_STD] == [1.0] * 3


def test_the_audio_tower_is_left_out(checkpoint, ggufs, tmp_path):
    """E2B / E4B's audio tower and embedder change nothing in the (vision) file."""
    other = copy_checkpoint(checkpoint, tmp_path / "base")
    audio = {"model.audio_tower.layers.0.lconv1d.linear_start.linear.weight": torch.randn(8, 4)}
    tensors = {
        **load_file(other / "model.safetensors"),
        **audio,
        "model.embed_audio.embedding_projection.weight": torch.randn(256, 8),
    }
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    path = convert_mmproj_to_gguf(other, tmp_path / "mm.gguf", name="mm")
    assert path.read_bytes() == ggufs[1].read_bytes()


def test_a_vision_config_llama_cpp_runs_otherwise_is_refused_with_every_reason(checkpoint, tmp_path):
    base = copy_checkpoint(checkpoint, tmp_path / "base")
    config = json.loads((base / "config.json").read_text())
    vision = {
        **config["vision_config"],
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        "hidden_activation": "silu",
        "num_key_value_heads": 1,
        "head_dim": 8,
    }
    (base / "config.json").write_text(json.dumps({**config, "vision_config": vision}))
    with pytest.raises(ValueError) as err:
        convert_mmproj_to_gguf(base, tmp_path / "x.gguf")
    message = str(err.value)  # every problem in one message
    assert "llama.cpp cannot run this gemma4 vision tower as transformers does" in message
    assert "vision rope_theta 10000.0 (llama.cpp's gemma4v graph fixes it at 100)" in message
    assert "hidden_activation 'silu'" in message and "num_key_value_heads 1 is not num_attention_heads 2" in message
    assert "head_dim 8 x 2 heads is not hidden_size 32" in message
    assert not list(tmp_path.glob("*.gguf"))


def test_export_writes_and_verifies_the_mmproj_beside_the_gemma4_gguf(checkpoint, tmp_path):
    pytest.importorskip("llama_cpp")
    check = exported_mmproj_check(checkpoint, tmp_path)
    # 144 px: 9 x 9 pooled tokens
    assert check["tokens"] == 81 and check["non_finite_tokens"] == 0, check
    assert 0 < check["max_abs_diff"] < BOUND * check["max_abs_embedding"], check
