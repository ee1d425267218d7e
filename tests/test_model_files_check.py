"""The weight-file check refuses no model that loads: every family's tiny model (tied heads, biases, fused
projections, post-norms), sharded or not, and a pre-quantized bitsandbytes 4-bit checkpoint (packed uint8
weights beside their quantization state). The broken folders it must refuse are in
tests/faults/test_validate_matches_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimtune.checks.model_files import weight_file_problems
from slimtune.checks.problems import meta_model
from slimtune.models.families import FAMILIES
from slimtune.models.tiny import build_model
from slimtune.spec.schema import ModelSpec


def _problems(model_dir: Path) -> list[str]:
    return weight_file_problems(ModelSpec(name_or_path=str(model_dir)), model_dir, meta_model(model_dir))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_saved_whole_and_sharded_passes(family, tmp_path):
    model = build_model(family, 300)
    model.save_pretrained(tmp_path / "whole")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert _problems(tmp_path / "whole") == [] and _problems(tmp_path / "sharded") == []
    # and the check can fail on this family: the weights without one tensor of the last layer
    weights = tmp_path / "whole" / "model.safetensors"
    tensors = load_file(weights)
    dropped = sorted(n for n in tensors if ".layers." in n)[-1]
    save_file({n: t for n, t in tensors.items() if n != dropped}, weights, metadata={"format": "pt"})
    assert f"lack 1 tensor(s) the model of its config.json needs (first: {dropped})" in " ".join(
        _problems(tmp_path / "whole")
    )


def test_a_prequantized_4bit_checkpoint_passes(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    build_model("llama", 300).save_pretrained(tmp_path / "base")
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=nf4, dtype=torch.float32
    ).save_pretrained(tmp_path / "bnb4")
    assert _problems(tmp_path / "bnb4") == []
