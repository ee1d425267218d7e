"""load_4bit's tables read straight into host memory (where the card is too small for the lm_head): the same model
as a plain load, in NF4 as load_4bit loads it, without either table ever placed on the load device."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.models.tiny import save_tiny
from slimtune.tasks.load_tables import load_host_tables, table_names, without_tables


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("untied") / "model", "llama", tie_word_embeddings=False)


def _load(cls, model_dir, **kwargs):
    quant = TRAINING_NF4.bnb_config(torch.float32)
    return cls.from_pretrained(
        model_dir, quantization_config=quant, dtype=torch.float32, device_map={"": "cpu"}, **kwargs
    )


def test_the_tables_load_into_host_memory_and_the_model_equals_a_plain_load(model_dir):
    plain = _load(LlamaForCausalLM, model_dir)
    hosted, info = _load(without_tables(LlamaForCausalLM), model_dir, output_loading_info=True)
    assert type(hosted) is LlamaForCausalLM  # transformers' own class once built
    names = table_names(hosted)
    assert names == {"model.embed_tokens.weight", "lm_head.weight"}
    # from_pretrained read neither table (it reports them unexpected) and left nothing missing
    assert set(info["unexpected_keys"]) == names and not info["missing_keys"]
    assert hosted.get_input_embeddings().weight is None and hosted.get_output_embeddings().weight is None

    load_host_tables(hosted, model_dir, torch.float32, pin=False)
    want, got = plain.state_dict(), hosted.state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert not hosted.lm_head.weight.requires_grad and not hosted.model.embed_tokens.weight.requires_grad
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.equal(hosted(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_table_missing_from_the_checkpoint_is_named(model_dir, tmp_path):
    shard = next(model_dir.glob("*.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        if f != shard:
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, v in load_file(shard).items() if k != "lm_head.weight"}
    save_file(tensors, broken / shard.name, metadata={"format": "pt"})
    hosted = _load(without_tables(LlamaForCausalLM), broken)
    with pytest.raises(FileNotFoundError, match=r"lm_head\.weight is in none of its safetensors shards"):
        load_host_tables(hosted, broken, torch.float32, pin=False)
    assert hosted.get_input_embeddings().weight is None  # nothing read before the check


def test_a_table_whose_kernel_did_not_apply_goes_back_where_the_model_computes(model_dir, caplog):
    """A patcher may refuse at run time; a table it leaves in host memory would meet the GPU's ids there: it goes
    to the compute device ("meta" stands in for the GPU here), with the patcher's reason in a warning."""
    from slimtune.kernels import KernelPatch
    from slimtune.tasks.load_tables import unread_tables_to_device

    hosted = _load(without_tables(LlamaForCausalLM), model_dir)
    load_host_tables(hosted, model_dir, torch.float32, pin=False)
    patch = KernelPatch(applied=["host_embedding"], skipped={"host_lm_head": "no pinned host memory for the head"})
    with caplog.at_level("WARNING", logger="slimtune.tasks.load_tables"):
        unread_tables_to_device(hosted, patch, torch.device("meta"))
    assert hosted.lm_head.weight.device.type == "meta" and not hosted.lm_head.weight.requires_grad
    assert hosted.model.embed_tokens.weight.device.type == "cpu"  # its kernel reads it on the host
    assert "host_lm_head did not apply (no pinned host memory for the head)" in caplog.text
