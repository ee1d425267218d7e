"""llama.cpp's vision projector GGUF (`mmproj`) for Gemma 3 multimodal checkpoints, run in llama.cpp's own mtmd.

A tiny Gemma 3: the pretrained tiny gemma3_text as its language model and a random two-layer SigLIP whose 8 x 8
patches (64 px images, 8 px patches) are pooled 2 x 2 into 16 image tokens, so that llama.cpp's pooling, its RMSNorm
(with Gemma's + 1) and the projection all take part. The vision weights are re-drawn non-trivially (transformers
initializes the projection to zeros), and the image processor's mean and std are not the defaults.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import huggingface_hub.constants as hf_constants
import numpy as np
import pytest
import torch
import transformers
from hub_server import FakeHub
from mmproj_checks import normalized, random_image, save_checkpoint, text_and_mmproj
from safetensors.torch import load_file, save_file

from slimtune.export.gguf_header import read_header
from slimtune.export.gguf_mmproj import (
    MMPROJ_MODEL_TYPES,
    convert_mmproj_to_gguf,
    llama_cpp_image_embeddings,
    writes_mmproj,
)
from slimtune.inference.generate import pick_gguf
from slimtune.models.multimodal import LAYOUTS
from slimtune.models.tiny import ensure_builtin, ensure_pretrained
from slimtune.report.run_report import write_run_report
from slimtune.spec.schema import PipelineSpec, parse_spec
from slimtune.tasks.gguf_convert_and_push import _mmproj, gguf_convert_and_push

TOKEN = "hf_SlimtuneFakeToken0123456789abcdefXYZ"
IMAGE_SIZE = 64
MEAN, STD = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,  # not the hidden size: llama.cpp would take fc1/fc2 for an old file's swapped pair
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": 8,
    "vision_use_head": False,  # as the released Gemma 3 configs say
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Gemma 3 multimodal checkpoint, saved as transformers saves it."""
    out = tmp_path_factory.mktemp("gemma3mm") / "base"
    text_dir = ensure_pretrained("gemma3_text", "gemma")
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    config = transformers.AutoConfig.for_model(
        "gemma3",
        text_config={**text.config.to_dict(), "pad_token_id": tokenizer.pad_token_id},
        vision_config=VISION,
        mm_tokens_per_image=16,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name:
                continue
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):  # LayerNorm scales near 1; Gemma's RMSNorm near 0 (1 + w)
                p.copy_((0.0 if "soft_emb" in name else 1.0) + 0.2 * noise)
            else:
                p.copy_(noise / max(1, p.shape[-1]) ** 0.5)
    return save_checkpoint(model, tokenizer, out, MEAN, STD)


@pytest.fixture(scope="module")
def ggufs(checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(text f16 GGUF, mmproj) of the checkpoint."""
    return text_and_mmproj(checkpoint, tmp_path_factory.mktemp("ggufs"))


def _image(seed: int) -> np.ndarray:
    return random_image(seed, IMAGE_SIZE, IMAGE_SIZE)


def _transformers_features(checkpoint: Path, rgb: np.ndarray) -> np.ndarray:
    """Gemma3ForConditionalGeneration.get_image_features on the pixels normalized here, as the image processor
    normalizes them (to [0, 1], then MEAN and STD), not through the module under test."""
    pixels = normalized(rgb, MEAN, STD)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.get_image_features(pixels).pooler_output[0].numpy()


def test_llama_cpp_image_embeddings_match_transformers(checkpoint, ggufs):
    pytest.importorskip("llama_cpp")
    text, mmproj = ggufs
    ours = llama_cpp_image_embeddings(text, mmproj, _image(0))
    reference = _transformers_features(checkpoint, _image(0))
    assert ours.shape == reference.shape == (16, 256)  # 8 x 8 patches pooled 2 x 2, in the text model's width
    scale = float(np.abs(reference).max())
    diff = float(np.abs(ours - reference).max())
    # Measured 7.1e-4 on embeddings up to 1.57 (4.5e-4 of the largest; 4.3e-4 to 5.0e-4 over four images): f16
    # weights and ggml's f16 matrix products each round to 2^-11 = 4.9e-4 relative. 2e-3 of the largest leaves 4x.
    # Measured against the layout mistakes it catches: the default mean/std instead of the processor's 0.77 off,
    # the norm without Gemma's + 1 1.55 off, the pooled tokens in column order 1.84 off.
    assert 0 < diff < 2e-3 * scale, (diff, scale)
    other = _transformers_features(checkpoint, _image(1))
    assert float(np.abs(ours - other).max()) > 0.1 * scale  # the control: another image is far off


def test_mmproj_holds_llama_cpps_gemma3_keys_and_tensors(checkpoint, ggufs):
    _, mmproj = ggufs
    header = read_header(mmproj)
    kv = header.kv
    vision = gguf.Keys.ClipVision
    assert kv[gguf.Keys.General.ARCHITECTURE] == "clip" and kv[gguf.Keys.General.TYPE] == "mmproj"
    assert kv[gguf.Keys.Clip.PROJECTOR_TYPE] == gguf.VisionProjectorType.GEMMA3
    assert kv[gguf.Keys.Clip.HAS_VISION_ENCODER] is True and kv[vision.USE_GELU] is True
    assert kv[vision.PROJECTION_DIM] == 256 and kv[vision.EMBEDDING_LENGTH] == 32 and kv[vision.BLOCK_COUNT] == 2
    assert kv[vision.IMAGE_SIZE] == 64 and kv[vision.PATCH_SIZE] == 8 and kv[vision.Projector.SCALE_FACTOR] == 2
    assert kv[vision.IMAGE_MEAN] == pytest.approx(MEAN) and kv[vision.IMAGE_STD] == pytest.approx(STD)
    types = {t.name: t.type for t in header.tensors}
    layer = ["ln1", "ln2", "attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down"]
    expected = {"v.patch_embd", "v.post_ln", *(f"v.blk.{i}.{n}" for i in range(2) for n in layer)}
    names = {f"{n}.{kind}" for n in expected for kind in ("weight", "bias")}
    names |= {"v.position_embd.weight", "mm.input_projection.weight", "mm.soft_emb_norm.weight"}
    assert set(types) == names
    Q = gguf.GGMLQuantizationType
    assert types["mm.input_projection.weight"] == types["v.blk.1.ffn_up.weight"] == Q.F16
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == types["v.blk.0.ln1.bias"] == Q.F32
    # Gemma's RMSNorm scales by 1 + w; clip.cpp by w
    stored = load_file(checkpoint / "model.safetensors")["multi_modal_projector.mm_soft_emb_norm.weight"]
    reader = gguf.GGUFReader(mmproj)
    [norm] = [t for t in reader.tensors if t.name == "mm.soft_emb_norm.weight"]
    np.testing.assert_array_equal(norm.data, stored.numpy() + 1)


# Gemma 3's key layouts the merge keeps: the Hub's checkpoints, and transformers 5's in-memory names
_LAYOUTS = {
    "hub": (("vision_tower.", "vision_tower.vision_model."),),
    "in_memory": (
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_each_key_layout_gives_the_same_mmproj(checkpoint, ggufs, tmp_path, layout):
    other = tmp_path / "base"
    other.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix != ".safetensors":
            (other / f.name).write_bytes(f.read_bytes())

    def renamed(key: str) -> str:
        return next((new + key.removeprefix(old) for old, new in _LAYOUTS[layout] if key.startswith(old)), key)

    tensors = {renamed(k): t for k, t in load_file(checkpoint / "model.safetensors").items()}
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    path = convert_mmproj_to_gguf(other, tmp_path / "mm.gguf", name="mm")
    assert path.read_bytes() == ggufs[1].read_bytes()


def test_other_checkpoints_and_unrunnable_vision_configs_are_refused(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    assert not writes_mmproj(tmp_path)
    supported = "supported: gemma3, mistral3, qwen3_5, gemma4"
    with pytest.raises(ValueError, match=f"model_type 'llava' has no mmproj writer; {supported}"):
        convert_mmproj_to_gguf(tmp_path, tmp_path / "x.gguf")
    vision = {**config["vision_config"], "intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps({**config, "mm_tokens_per_image": 9, "vision_config": vision}))
    with pytest.raises(ValueError) as err:
        convert_mmproj_to_gguf(tmp_path, tmp_path / "x.gguf")
    message = str(err.value)  # both problems in one message
    assert "mm_tokens_per_image 9 is not the square of a divisor of the 8 patches" in message
    assert "intermediate_size equals hidden_size (32)" in message
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".x*"))


def test_every_multimodal_layout_gets_an_mmproj_and_unrunnable_towers_export_the_text_gguf_alone_and_say_so(
    checkpoint, tmp_path, caplog
):
    assert set(MMPROJ_MODEL_TYPES) == set(LAYOUTS)  # a multimodal checkpoint slimtune trains keeps its vision in GGUF
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert _mmproj(PipelineSpec(name="r"), tmp_path, tmp_path, [tmp_path / "r.gguf"]) is None  # a text checkpoint
    config = json.loads((checkpoint / "config.json").read_text())
    caplog.set_level(logging.INFO, logger="slimtune.tasks.gguf_convert_and_push")
    # a Gemma 3 vision config llama.cpp would run differently: the text GGUFs stand, the record and log say why
    (tmp_path / "config.json").write_text(json.dumps({**config, "mm_tokens_per_image": 9}))
    record = _mmproj(PipelineSpec(name="r"), tmp_path, tmp_path, [tmp_path / "r.gguf"])
    assert "mm_tokens_per_image 9 is not the square" in record["skipped"] and "file" not in record
    assert "no mmproj file: " in caplog.text
    assert not list(tmp_path.glob("*.gguf"))


def _export(tmp_path: Path, model: Path, gguf_types: list[str], verify: bool, push: dict | None = None) -> dict:
    """gguf_convert_and_push of `model` as the merged model, and the run report written from its result."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    spec = parse_spec(
        {
            "name": "r",
            "model": {"name_or_path": str(model), "device": "cpu"},
            "data": {"path": str(data)},
            "output_dir": str(tmp_path / "out"),
            "export": {"gguf": gguf_types, "verify": verify, "push": push},
        }
    )
    summary = {"spec": spec.model_dump(mode="json"), "train": {"steps": 1}}
    result = gguf_convert_and_push(spec, model, tmp_path / "adapter", summary).to_dict()
    write_run_report(spec.run_dir(), {**summary, "gguf_convert_and_push": result})
    return result


def test_export_writes_verifies_and_pushes_the_mmproj_beside_the_gemma3_gguf(checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    # the checkpoint stands in for merged/ (the merge copies the vision weights and preprocessor_config.json as stored)
    with FakeHub(token=TOKEN) as hub:
        # huggingface_hub pointed at the fake Hub for this test only (as tests/test_push.py does)
        for name, value in (("HF_ENDPOINT", hub.endpoint), ("HF_HUB_DISABLE_XET", "1"), ("HF_TOKEN", TOKEN)):
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        result = _export(tmp_path, checkpoint, ["q8_0"], verify=True, push={"repo_id": "someone/mm-gguf"})
        pushed, commits = hub.files("someone/mm-gguf"), hub.commits("someone/mm-gguf")
    folder = tmp_path / "out" / "r" / "gguf"
    assert sorted(p.name for p in folder.glob("*.gguf")) == ["r-mmproj-f16.gguf", "r-q8_0.gguf"]
    mmproj = result["mmproj"]
    assert mmproj["file"] == "r-mmproj-f16.gguf" and mmproj["bytes"] == (folder / "r-mmproj-f16.gguf").stat().st_size
    check = mmproj["verification"]
    assert check["tokens"] == 16 and 0 < check["max_abs_diff"] < 2e-3 * check["max_abs_embedding"], check
    assert list(result["files"]) == ["r-q8_0.gguf"]  # the model files, as before
    card = (folder / "README.md").read_text()
    assert "| r-mmproj-f16.gguf | f16 vision projector (--mmproj) |" in card
    assert "FROM ./r-q8_0.gguf" in (folder / "Modelfile").read_text()
    report = (tmp_path / "out" / "r" / "report.md").read_text()
    assert "Vision projector (`--mmproj`): `r-mmproj-f16.gguf`" in report and "16 tokens" in report
    # pushed in the same commit as the rest, byte for byte
    assert [c.summary for c in commits] == ["initial commit", "slimtune: r"]
    assert set(pushed) == {".gitattributes", "README.md", "Modelfile", "r-q8_0.gguf", "r-mmproj-f16.gguf"}
    assert pushed["r-mmproj-f16.gguf"] == (folder / "r-mmproj-f16.gguf").read_bytes()
    # `slimtune generate` loads a model GGUF, never the projector (an f16 file would outrank q8_0)
    assert pick_gguf(tmp_path / "out" / "r").name == "r-q8_0.gguf"


def test_export_of_a_text_model_writes_no_mmproj(tmp_path):
    result = _export(tmp_path, ensure_builtin("builtin:tiny-llama"), ["f16"], verify=False)
    assert result["mmproj"] is None
    assert "Vision projector" not in (tmp_path / "out" / "r" / "report.md").read_text()
    assert [p.name for p in (tmp_path / "out" / "r" / "gguf").glob("*.gguf")] == ["r-f16.gguf"]
