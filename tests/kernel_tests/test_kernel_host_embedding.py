"""The frozen input-embedding table in host memory: rows gathered by a Triton kernel, patched reversibly."""

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from peft import LoraConfig, get_peft_model

from slimtune.kernels import apply_kernels
from slimtune.kernels.host_embedding import gather_rows, reference_gather_rows
from slimtune.models.tiny import build_model


def test_gather_rows_is_exact():
    torch.manual_seed(0)
    table = torch.randn(50, 1100).bfloat16()  # a width that is not a multiple of the column block
    ids = torch.tensor([[3, 49, 0, 3], [7, 7, 12, 1]])
    got = gather_rows(table, ids)
    assert got.shape == (2, 4, 1100) and got.dtype == torch.bfloat16
    assert torch.equal(got, reference_gather_rows(table, ids))
    assert gather_rows(table, torch.empty(0, dtype=torch.long)).shape == (0, 1100)


def _lora(family: str, **config):
    model = build_model(family, 128, num_hidden_layers=1, **config)
    model.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).train()


def test_patch_moves_the_table_off_the_model_device_and_undo_brings_it_back():
    model = _lora("llama")
    emb = model.get_base_model().get_input_embeddings()
    ids = torch.randint(0, 128, (2, 9))
    ref = model(input_ids=ids, labels=ids).loss
    before = emb.weight.detach().clone()
    patch = apply_kernels(model, ["host_embedding"])
    try:
        assert patch.modules == {"host_embedding": 1}, patch.skipped
        assert "forward" in emb.__dict__ and not emb.weight.requires_grad
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref, rtol=0, atol=0)
    finally:
        patch.undo()
    assert "forward" not in emb.__dict__ and torch.equal(emb.weight, before)
    assert not emb.weight.requires_grad


@pytest.mark.parametrize("case,reason", [("tied", "tied to the output head"), ("trained", "are trained")])
def test_tied_or_trained_embeddings_stay_put(case, reason):
    model = build_model("llama", 128, num_hidden_layers=1, tie_word_embeddings=case == "tied")
    if case == "tied":
        model.requires_grad_(False)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    patch = apply_kernels(model, ["host_embedding"])
    assert patch.applied == [] and reason in patch.skipped["host_embedding"]
    assert "forward" not in model.get_input_embeddings().__dict__
