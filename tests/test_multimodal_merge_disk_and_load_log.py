"""A multimodal Qwen3.5 checkpoint's weights outside the language model (vision tower, multi-token prediction `mtp.*`):
`plan` counts the disk the merge writes for them, and load_4bit says in one line that it left them for the merge
instead of transformers' load report listing each one (while a key outside those parts is still reported).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from checkpoint_files import checkpoint_tensors
from random_adapter import merge_random_adapter
from safetensors.torch import save_file

from slimtune.core import registry
from slimtune.models.multimodal import text_key
from slimtune.models.source import ModelSourceError
from slimtune.models.tiny import save_tiny, save_tiny_multimodal
from slimtune.plan.fit import Budget, model_config, plan, stored_tensor_bytes
from slimtune.spec.schema import ModelSpec, PipelineSpec
from slimtune.tasks.load_4bit import load_4bit

# A released Qwen3.5 checkpoint's multi-token prediction: one decoder layer of the model's width beside `fc`, which
# transformers' class does not load. At the tiny's width (256, MLP 512) these are 1.0M fp32 parameters (4.2 MB):
# ~1.4x the bf16 language model the merge writes, so leaving them out of the plan would be far outside the tolerance.
_MTP = {
    "mtp.fc.weight": (256, 512),
    "mtp.layers.0.self_attn.q_proj.weight": (512, 256),
    "mtp.layers.0.self_attn.k_proj.weight": (256, 256),
    "mtp.layers.0.self_attn.v_proj.weight": (256, 256),
    "mtp.layers.0.self_attn.o_proj.weight": (256, 256),
    "mtp.layers.0.mlp.gate_proj.weight": (512, 256),
    "mtp.layers.0.mlp.up_proj.weight": (512, 256),
    "mtp.layers.0.mlp.down_proj.weight": (256, 512),
    "mtp.norm.weight": (256,),
}


def _add_tensors(model_dir: Path, extra: dict[str, torch.Tensor]) -> None:
    [shard] = model_dir.glob("*.safetensors")
    save_file({**checkpoint_tensors(model_dir), **extra}, str(shard), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny Qwen3.5 as the language model of the released checkpoints' layout (`model.language_model.*`,
    `model.visual.*`) with the multi-token-prediction weights they also hold, stored in fp32."""
    root = tmp_path_factory.mktemp("qwen35mm")
    out = save_tiny_multimodal(root / "base", save_tiny(root / "text", "qwen3_5_text"), "qwen3_5")
    generator = torch.Generator().manual_seed(0)
    _add_tensors(out, {k: torch.randn(shape, generator=generator) for k, shape in _MTP.items()})
    return out


def _spec(base: Path, root: Path) -> PipelineSpec:
    spec = PipelineSpec(name="mm", output_dir=str(root / "runs"))
    spec.model = ModelSpec(name_or_path=str(base), device="cpu")
    spec.lora.dropout = 0.0
    spec.merge.output_dtype = "bfloat16"  # as the released checkpoints; the copied weights stay as stored (fp32)
    return spec


def test_plan_disk_for_the_merge_is_what_the_merge_writes(base, tmp_path):
    spec = _spec(base, tmp_path)
    merged = merge_random_adapter(spec, tmp_path / "adapter")
    assert {k for k in checkpoint_tensors(merged) if k.startswith("mtp.")} == set(_MTP)  # the merge copies them
    rows, _ = plan(spec, model_config(spec), Budget(None, None, None))
    (merge,) = [r for r in rows if r.stage == "dequant_merge"]
    planned = merge.estimate.disk_bytes
    # the tensors' bytes, exactly: the bf16 language model plus the tower and mtp as stored (before the plan
    # counted them from a meta-device model, which has no mtp: 3,408,896 bytes short, 34% of these)
    tensors = sum(t.numel() * t.element_size() for t in checkpoint_tensors(merged).values())
    assert planned == tensors
    # The folder also holds the safetensors header, the index, config, tokenizer and manifest, which the merge's
    # disk preflight covers with a fixed 64 MiB (not the plan's figure): measured 66.5 KB here, 0.7% of the folder
    # (a real checkpoint's are ~10 MB against GBs). 1% holds them and is 34x below what leaving out mtp costs.
    written = sum(f.stat().st_size for f in merged.iterdir())
    assert 0 < written - planned < 0.01 * written


@pytest.mark.parametrize(
    "model_type, text_family",
    [("gemma3", "gemma3_text"), ("mistral3", "mistral"), ("gemma4", "gemma4_text"), ("qwen3_5", "qwen3_5_text")],
)
def test_load_says_in_one_line_what_it_left_for_the_merge_and_still_reports_a_stray_key(
    model_type, text_family, tmp_path, caplog, capfd
):
    base = save_tiny_multimodal(tmp_path / "base", save_tiny(tmp_path / "text", text_family), model_type)
    if model_type == "qwen3_5":
        _add_tensors(base, {k: torch.zeros(shape) for k, shape in _MTP.items()})
    left = [k for k in checkpoint_tensors(base) if text_key(k) is None]
    vision = [k for k in left if not k.startswith("mtp.")]
    mtp = len(left) - len(vision)  # 9 in the Qwen3.5 checkpoint, none in the others
    expected = f"left {mtp} mtp and {len(vision)} vision tower tensors" if mtp else f"left {len(vision)} vision tower"

    def load() -> tuple[list[logging.LogRecord], str]:
        caplog.clear()
        capfd.readouterr()
        with caplog.at_level(logging.INFO, logger="slimtune.tasks.load_4bit"):
            try:
                load_4bit(_spec(base, tmp_path))
            finally:
                registry.release_all()
        out = capfd.readouterr()  # transformers' own logger writes to stderr, not through the root logger
        records = [r for r in caplog.records if r.name == "slimtune.tasks.load_4bit"]
        return records, out.out + out.err + caplog.text

    records, shown = load()
    assert not [k for k in vision if k in shown]  # no vision key listed anywhere (Gemma 3's report had them all)
    [line] = [r.getMessage() for r in records if "for the merge to copy as stored" in r.getMessage()]
    assert expected in line, line
    assert not [r for r in records if r.levelno >= logging.WARNING]  # nothing else was left out
    # a key the language model should have had, and one outside the known parts: both still reported
    some_text_key = next(k for k in checkpoint_tensors(base) if k.endswith("layers.0.mlp.down_proj.weight"))
    stray = some_text_key.replace("down_proj", "stray_proj")
    _add_tensors(base, {stray: torch.zeros(4, 4), "audio_tower.proj.weight": torch.zeros(4, 4)})
    records, shown = load()
    [warning] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert "did not load 2 checkpoint keys" in warning and "audio_tower.proj.weight" in warning, warning
    assert "layers.0.mlp.stray_proj.weight" in warning, warning
    assert not [k for k in vision if k in shown]


def test_plan_without_the_hubs_safetensors_headers_says_so_in_one_line():
    # the tests run offline (conftest): reading a Hub model's headers fails as the Hub being unreachable would
    spec = PipelineSpec.model_validate({"name": "g", "model": {"name_or_path": "google/gemma-3-4b-it"}})
    with pytest.raises(ModelSourceError) as e:
        stored_tensor_bytes(spec)
    assert "\n" not in str(e.value) and "cannot read the safetensors headers of 'google/gemma-3-4b-it'" in str(e.value)
