"""llama.cpp's vision projector GGUF (`mmproj`) for Mistral 3 checkpoints (projector type "pixtral"), run in mtmd.

A tiny Mistral 3: the pretrained tiny Mistral as its language model, with an [IMG_BREAK] token added, and a random
two-layer Pixtral (silu, as the released Mistral Small 3.1 tower) whose 8 px patches are merged 2 x 2, so that the
2D rope (its q/k rows permuted for ggml), the projector's RMSNorm, the patch merger, the GELU MLP and llama.cpp's
[IMG_BREAK] rows all take part. The image processor's mean and std are not the defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from mmproj_checks import (
    copy_checkpoint,
    exported_mmproj_check,
    normalized,
    random_image,
    randomize_tower,
    save_checkpoint,
    text_and_mmproj,
)
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken

from slimtune.export.gguf_header import read_header
from slimtune.export.gguf_mmproj import convert_mmproj_to_gguf, llama_cpp_image_embeddings
from slimtune.models.tiny import ensure_pretrained
from slimtune.report.run_report import _mmproj_lines

PATCH, MERGE = 8, 2
MEAN, STD = [0.47, 0.45, 0.42], [0.25, 0.27, 0.29]
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 64,
    "patch_size": PATCH,
    "hidden_act": "silu",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Mistral 3 checkpoint, saved as transformers saves it."""
    out = tmp_path_factory.mktemp("mistral3mm") / "base"
    text_dir = ensure_pretrained("mistral", "llama2")
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_tokens([AddedToken("[IMG_BREAK]", special=True)])
    text.resize_token_embeddings(len(tokenizer))
    config = transformers.AutoConfig.for_model(
        "mistral3",
        # 1e-5: the projector norm's eps in transformers, llama.cpp's is the vision tower's 1e-5
        text_config={**text.config.to_dict(), "pad_token_id": tokenizer.pad_token_id, "rms_norm_eps": 1e-5},
        vision_config=VISION,
        spatial_merge_size=MERGE,
    )
    config.architectures = ["Mistral3ForConditionalGeneration"]
    config.tie_word_embeddings = False
    model = transformers.Mistral3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    generator = torch.Generator().manual_seed(0)
    # RMSNorm scales near 1
    randomize_tower(model, generator, lambda name, noise, _: 1.0 + 0.2 * noise if "norm" in name else None)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[-1] = torch.randn(embeddings.shape[1], generator=generator) * embeddings[:-1].std()
    return save_checkpoint(model, tokenizer, out, MEAN, STD)


@pytest.fixture(scope="module")
def ggufs(checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(text f16 GGUF, mmproj) of the checkpoint."""
    return text_and_mmproj(checkpoint, tmp_path_factory.mktemp("ggufs"))


def _transformers_embeddings(checkpoint: Path, rgb: np.ndarray) -> np.ndarray:
    """What the language model receives for the image in transformers: Mistral3's get_image_features on the pixels
    normalized here (to [0, 1], then MEAN and STD), a row of merged patches at a time, each but the last followed by
    [IMG_BREAK]'s embedding (Mistral's processor writes the token there), not through the module under test."""
    pixels = normalized(rgb, MEAN, STD)
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    height, width = rgb.shape[:2]
    with torch.no_grad():
        features = model.get_image_features(pixels, image_sizes=torch.tensor([[height, width]])).pooler_output[0]
        brk = model.get_input_embeddings().weight[-1].detach()  # [IMG_BREAK], the token added last
    rows = features.reshape(height // (PATCH * MERGE), width // (PATCH * MERGE), -1)
    out = []
    for i, row in enumerate(rows):
        out += [row] if i == len(rows) - 1 else [row, brk[None]]
    return torch.cat(out).numpy()


def _break_rows(height: int, width: int) -> list[int]:
    """Where llama.cpp puts [IMG_BREAK]: after each row of merged patches but the last."""
    per_row = width // (PATCH * MERGE)
    return [(i + 1) * (per_row + 1) - 1 for i in range(height // (PATCH * MERGE) - 1)]


def _off(ours: np.ndarray, reference: np.ndarray, height: int, width: int) -> tuple[float, float]:
    """(largest difference, largest reference value) over the image tokens; the [IMG_BREAK] rows are llama.cpp's
    copy of the f32 embedding row, equal to the bit where finite (llama.cpp 0.3.36 builds them on an unwritten buffer
    scaled by 0, which keeps a NaN found there: 3 of 21 calls here)."""
    breaks = _break_rows(height, width)
    finite = [i for i in breaks if np.isfinite(ours[i]).all()]
    np.testing.assert_array_equal(ours[finite], reference[finite])
    image = np.setdiff1d(np.arange(len(reference)), breaks)
    return float(np.abs(ours[image] - reference[image]).max()), float(np.abs(reference[image]).max())


@pytest.mark.parametrize(("height", "width", "tokens"), [(64, 64, 4 * 4 + 3), (48, 64, 3 * 4 + 2)])
def test_llama_cpp_image_embeddings_match_transformers(checkpoint, ggufs, height, width, tokens):
    pytest.importorskip("llama_cpp")
    text, mmproj = ggufs
    ours = llama_cpp_image_embeddings(text, mmproj, random_image(0, height, width))
    reference = _transformers_embeddings(checkpoint, random_image(0, height, width))
    # merged patches and an [IMG_BREAK] after each row but the last, in the text model's width; 48 x 64 (3 rows of
    # 4) also fixes which way the rows run
    assert ours.shape == reference.shape == (tokens, 256)
    diff, scale = _off(ours, reference, height, width)
    # Measured 8.2e-4 to 1.27e-3 of the largest (up to 3.2) over 12 images of 4 shapes, about the same with every
    # weight f32 in the file (7.9e-4 to 1.28e-3): ggml's own rounding on the CPU (its GELU is the tanh one,
    # transformers' the erf one: 1.6e-4 of it), not the file's f16. 2e-3 of the largest leaves 1.6x.
    assert 0 < diff < 2e-3 * scale, (diff, scale)
    other = _transformers_embeddings(checkpoint, random_image(1, height, width))
    assert float(np.abs(ours - other)[np.isfinite(ours)].max()) > 0.1 * scale  # the control: another image is far off


def _unpermute(w: torch.Tensor) -> torch.Tensor:
    """The inverse of the writer's q/k row permutation for ggml's rope (pairs back to halves), per head."""
    heads = VISION["num_attention_heads"]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# The mistakes the check exists for, each a file the writer makes from a changed checkpoint, compared with the
# transformers embeddings of the original: the image processor's mean and std left out (CLIP's defaults instead),
# and q/k rows as stored (a checkpoint with them un-permuted comes out of the writer as the stored rows)
_MISTAKES = {
    "default_mean_std": {"preprocessor": False},
    "no_qk_permute": {"change": lambda k, t: _unpermute(t) if k.endswith(("q_proj.weight", "k_proj.weight")) else t},
}


@pytest.mark.parametrize("mistake", sorted(_MISTAKES))
def test_the_check_catches_a_wrong_mmproj(checkpoint, ggufs, tmp_path, mistake):
    pytest.importorskip("llama_cpp")
    text, _ = ggufs
    wrong = convert_mmproj_to_gguf(
        copy_checkpoint(checkpoint, tmp_path / "base", **_MISTAKES[mistake]), tmp_path / "w.gguf"
    )
    ours = llama_cpp_image_embeddings(text, wrong, random_image(0, 48, 64))
    diff, scale = _off(ours, _transformers_embeddings(checkpoint, random_image(0, 48, 64)), 48, 64)
    # measured 0.13 of the largest with CLIP's mean and std, 0.49 with the q/k rows as stored
    assert diff > 2e-3 * scale, (diff, scale)


def test_mmproj_holds_llama_cpps_pixtral_keys_and_tensors(checkpoint, ggufs):
    _, mmproj = ggufs
    kv = read_header(mmproj).kv
    vision = gguf.Keys.ClipVision
    assert kv[gguf.Keys.General.ARCHITECTURE] == "clip" and kv[gguf.Keys.General.TYPE] == "mmproj"
    assert kv[gguf.Keys.Clip.PROJECTOR_TYPE] == gguf.VisionProjectorType.PIXTRAL
    assert kv[vision.USE_SILU] is True and vision.USE_GELU not in kv  # clip.cpp refuses both
    assert kv[vision.PROJECTION_DIM] == 256 and kv[vision.EMBEDDING_LENGTH] == 32 and kv[vision.BLOCK_COUNT] == 2
    assert kv[vision.IMAGE_SIZE] == 64 and kv[vision.PATCH_SIZE] == PATCH and kv[vision.SPATIAL_MERGE_SIZE] == MERGE
    assert kv[vision.Attention.LAYERNORM_EPS] == pytest.approx(1e-5)
    assert kv[vision.IMAGE_MEAN] == pytest.approx(MEAN) and kv[vision.IMAGE_STD] == pytest.approx(STD)
    tensors = {t.name: t for t in gguf.GGUFReader(mmproj).tensors}
    layer = ["ln1", "ln2", "attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down"]
    names = {f"v.blk.{i}.{n}.weight" for i in range(2) for n in layer}
    names |= {f"{n}.weight" for n in ("v.patch_embd", "v.pre_ln", "mm.input_norm", "mm.patch_merger", "mm.1", "mm.2")}
    assert set(tensors) == names | {"v.token_embd.img_break"}
    Q = gguf.GGMLQuantizationType
    assert {tensors[n].tensor_type for n in ("mm.1.weight", "mm.patch_merger.weight", "v.patch_embd.weight")} == {Q.F16}
    assert {tensors[n].tensor_type for n in ("v.pre_ln.weight", "v.token_embd.img_break")} == {Q.F32}
    stored = load_file(checkpoint / "model.safetensors")
    # [IMG_BREAK]'s row of the text embeddings, the token added last
    embeddings = next(t for k, t in stored.items() if k.endswith("embed_tokens.weight"))
    np.testing.assert_array_equal(tensors["v.token_embd.img_break"].data, embeddings[-1].numpy())
    # q/k rows permuted for ggml's rope, which _unpermute (the negative check's) undoes
    q = torch.from_numpy(tensors["v.blk.1.attn_q.weight"].data.astype(np.float32))
    rows = stored["vision_tower.transformer.layers.1.attention.q_proj.weight"].half().float()
    assert not torch.equal(q, rows)
    assert torch.equal(_unpermute(q), rows)


def test_a_vision_config_llama_cpp_runs_otherwise_is_refused_with_every_reason(checkpoint, tmp_path):
    base = copy_checkpoint(checkpoint, tmp_path / "base")
    config = json.loads((base / "config.json").read_text())
    text = {**config["text_config"], "rms_norm_eps": 1e-6}
    (base / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -2, "text_config": text}))
    for name, key in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
        data = json.loads((base / name).read_text())
        tokens = data.get(key) or []
        if isinstance(tokens, dict):
            data[key] = {i: t for i, t in tokens.items() if t["content"] != "[IMG_BREAK]"}
        else:
            data[key] = [t for t in tokens if t["content"] != "[IMG_BREAK]"]
        (base / name).write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        convert_mmproj_to_gguf(base, tmp_path / "x.gguf")
    message = str(err.value)  # every problem in one message
    assert "llama.cpp cannot run this mistral3 vision tower as transformers does" in message
    assert "vision_feature_layer -2" in message and "text rms_norm_eps 1e-06" in message
    assert "no [IMG_BREAK] token in the tokenizer" in message
    assert not list(tmp_path.glob("*.gguf"))


def test_export_writes_and_verifies_the_mmproj_beside_the_mistral3_gguf(checkpoint, tmp_path):
    pytest.importorskip("llama_cpp")
    check = exported_mmproj_check(checkpoint, tmp_path)
    # 64 px: 4 rows of 4 merged patches and 3 [IMG_BREAK]s, only which llama.cpp may leave NaN (see _off)
    assert check["tokens"] == 19 and check["non_finite_tokens"] <= 3, check
    assert 0 < check["max_abs_diff"] < 2e-3 * check["max_abs_embedding"], check


def test_the_report_names_the_tokens_llama_cpp_left_not_finite():
    check = {"max_abs_diff": 1e-3, "max_abs_embedding": 3.0, "tokens": 19, "non_finite_tokens": 2}
    record = {"file": "r-mmproj-f16.gguf", "bytes": 2048}
    [line, _] = _mmproj_lines({**record, "verification": check})
    assert line.endswith("(largest 3, 19 tokens), 2 of them not finite in llama.cpp and left out."), line
    [line, _] = _mmproj_lines({**record, "verification": {**check, "non_finite_tokens": 0}})
    assert line.endswith("(largest 3, 19 tokens)."), line


def test_transformers_in_memory_names_give_the_same_mmproj(checkpoint, ggufs, tmp_path):
    other = copy_checkpoint(checkpoint, tmp_path / "base")
    # the Hub's names (which transformers 5.23 saves) to transformers 5's in memory
    layouts = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    renamed = {
        next(new + k.removeprefix(old) for old, new in layouts if k.startswith(old)): t
        for k, t in load_file(other / "model.safetensors").items()
    }
    assert sum(k.startswith("model.vision_tower.") for k in renamed) == 2 * 9 + 2
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    path = convert_mmproj_to_gguf(other, tmp_path / "mm.gguf", name="mm")
    assert path.read_bytes() == ggufs[1].read_bytes()


def test_the_check_excuses_only_the_rows_llama_cpp_inserts(checkpoint, ggufs, monkeypatch):
    """verify_mmproj leaves out non-finite rows only where llama.cpp inserts [IMG_BREAK]; a non-finite row encoded
    from the image fails it."""
    pytest.importorskip("llama_cpp")
    from slimtune.export import GGUFVerifyError, gguf_mmproj
    from slimtune.export.mmproj_families import MMPROJ_FAMILIES

    text, mmproj = ggufs
    kv = read_header(mmproj).kv
    for height, width in ((64, 64), (48, 64)):
        assert MMPROJ_FAMILIES["mistral3"].inserted_rows(height, width, kv) == _break_rows(height, width)
    assert MMPROJ_FAMILIES["gemma3"].inserted_rows(64, 64, kv) == []
    size = MMPROJ_FAMILIES["mistral3"].verify_size(kv)
    real = gguf_mmproj.llama_cpp_image_embeddings

    def with_nan(row: int):
        def embeddings(*args):
            out = real(*args).copy()
            out[row] = np.nan
            return out

        return embeddings

    monkeypatch.setattr(gguf_mmproj, "llama_cpp_image_embeddings", with_nan(_break_rows(*size)[0]))
    assert gguf_mmproj.verify_mmproj(mmproj, text, checkpoint)["non_finite_tokens"] >= 1
    monkeypatch.setattr(gguf_mmproj, "llama_cpp_image_embeddings", with_nan(0))
    with pytest.raises(GGUFVerifyError, match=r"non-finite embeddings for image tokens \[0"):
        gguf_mmproj.verify_mmproj(mmproj, text, checkpoint)
