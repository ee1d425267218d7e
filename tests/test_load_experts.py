"""load_4bit's MoE experts, read and quantized one layer at a time: equal to quantizing after a full 16-bit load, and
never more than one layer's experts in 16 bits at once."""

from __future__ import annotations

import logging
import re
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from slimtune.core import registry
from slimtune.kernels.nf4_experts import NF4Experts, quantize_model_experts
from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.models.tiny import save_tiny
from slimtune.spec.schema import ModelSpec, PipelineSpec
from slimtune.tasks.load_4bit import keep_training_layout, load_4bit
from slimtune.tasks.load_experts import load_nf4_experts, without_dense_experts

_CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The builtin tiny qwen3_moe's recipe: 4 layers of 8 experts (hidden 256, expert width 128), float32."""
    return save_tiny(tmp_path_factory.mktemp("moe") / "model", "qwen3_moe")


@pytest.fixture(autouse=True)
def _empty_registry():
    yield
    registry.release_all()


def _nf4_load_kwargs(dtype: torch.dtype) -> dict:
    return dict(quantization_config=TRAINING_NF4.bnb_config(dtype), dtype=dtype, device_map={"": "cpu"})


def _expert_blocks(model: torch.nn.Module) -> list[NF4Experts]:
    return [m for m in model.modules() if isinstance(m, NF4Experts)]


def _nf4_tensors(block: NF4Experts) -> dict[str, torch.Tensor]:
    """Every stored field of both projections (gate and up apart): packed bytes, absmax codes, absmax2, offset."""
    return {name: t for name, t in block.named_buffers() if not name.endswith(("code", "code2"))}


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])  # bf16: the float32 checkpoint is cast on load
def test_layer_by_layer_equals_quantizing_after_the_full_load(model_dir, compute_dtype, caplog):
    spec = PipelineSpec()
    spec.model = ModelSpec(name_or_path=str(model_dir), device="cpu", compute_dtype=compute_dtype)
    with caplog.at_level(logging.INFO):
        loaded = load_4bit(spec)
    model = registry.get(loaded.handle)
    assert "4 expert blocks" in caplog.text
    assert "UNEXPECTED" not in caplog.text and "did not load" not in caplog.text  # the fused names are not news
    assert type(model) is Qwen3MoeForCausalLM  # the family's own class, not the loading subclass
    dtype = getattr(torch, compute_dtype)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, **_nf4_load_kwargs(dtype))  # the 16-bit experts
    keep_training_layout(reference)
    assert quantize_model_experts(reference, dtype) == 4
    blocks, expected = _expert_blocks(model), _expert_blocks(reference)
    assert len(blocks) == len(expected) == 4
    for block, reference_block in zip(blocks, expected):
        ours, theirs = _nf4_tensors(block), _nf4_tensors(reference_block)
        assert sorted(ours) == sorted(theirs) and len(ours) == 12  # (gate, up, down) x 4 fields
        for name, tensor in ours.items():
            assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, reference_logits = model(ids).logits, reference(ids).logits
    assert torch.isfinite(logits).all() and torch.equal(logits, reference_logits)


def test_one_layer_of_16_bit_experts_at_a_time(model_dir):
    """Each fused tensor's memory (its storage, whichever tensors view it) is watched by a weak reference from the
    moment it is materialized: the most 16-bit expert bytes alive at once is one layer's (gate_up + down), and none
    outlives the load. A loader that read every layer before quantizing, or kept any layer's dense tensors, would
    show up to 4 layers here."""
    model = without_dense_experts(Qwen3MoeForCausalLM).from_pretrained(model_dir, **_nf4_load_kwargs(torch.bfloat16))
    assert type(model) is Qwen3MoeForCausalLM
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj is None and experts.down_proj is None  # from_pretrained materialized none of them
    alive: list[weakref.ref] = []  # torch keeps one Python object per storage while any tensor uses it
    peaks: list[int] = []

    def watch(fused: torch.Tensor) -> None:
        alive.append(weakref.ref(fused.untyped_storage()))
        peaks.append(sum(s.nbytes() for ref in alive if (s := ref()) is not None))

    assert load_nf4_experts(model, model_dir, torch.bfloat16, _CPU, on_dense=watch) == 4
    config = model.config
    layer = config.num_experts * 3 * config.moe_intermediate_size * config.hidden_size * 2  # gate, up, down in bf16
    assert len(peaks) == 4 * 2  # gate_up and down of each layer
    assert max(peaks) == layer
    assert all(ref() is None for ref in alive)  # freed: only the NF4 copies remain
    assert len(_expert_blocks(model)) == 4


def test_a_missing_expert_matrix_is_named(model_dir, tmp_path):
    [shard] = sorted(model_dir.glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / shard.name, metadata={"format": "pt"})
    model = without_dense_experts(Qwen3MoeForCausalLM).from_pretrained(model_dir, **_nf4_load_kwargs(torch.float32))
    message = "model.layers.2.mlp.experts.5.up_proj.weight is in none of its safetensors shards (1 expert matrices"
    with pytest.raises(FileNotFoundError, match="^" + re.escape(f"{tmp_path}: {message}")):
        load_nf4_experts(model, tmp_path, torch.float32, _CPU)
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Qwen3MoeExperts" and experts.gate_up_proj is None  # nothing read before the check
