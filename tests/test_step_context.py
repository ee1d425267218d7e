"""`step_context`: what wraps one `Trainer.train` call is entered for one process only, reaches every
checkpointed layer, and leaves nothing on the model when the block ends."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimtune.models.tiny import build_model
from slimtune.train.step import StepSettings, enable_checkpointing, step_context
from slimtune.train.step.checkpointing import _patched

_LAYERS = 3


@pytest.fixture
def model():
    base = build_model("llama", 64, num_hidden_layers=_LAYERS)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).train()


def _listed(model) -> list[int | None]:
    return [None if f.listed is None else len(f.listed) for f, _ in _patched(model)]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_one_process_gets_lists_and_everything_goes_at_the_end(model, cuda_graphs):
    with enable_checkpointing(model, "unsloth"):
        settings = StepSettings(single_process=True, cuda_graphs=cuda_graphs, stored_layers=2)
        with step_context(model, settings) as step:
            assert step.walks and "parameters" in model.__dict__
            assert step.listed == _LAYERS
            assert _listed(model) == [4] * _LAYERS  # q and v, A and B, per layer
            assert step.stored == 2 and [f.stored for f, _ in _patched(model)] == [False, True, True]  # the last
            assert step.graphs is None  # asked for or not: no CUDA device here (`graphs_refusal`)
        assert _listed(model) == [None] * _LAYERS
        assert not any(f.stored for f, _ in _patched(model))
        assert not {"train", "parameters", "zero_grad"} & set(model.__dict__)


def test_several_processes_run_the_step_as_the_library_does(model):
    with enable_checkpointing(model, "unsloth"):
        with step_context(model, StepSettings(single_process=False, cuda_graphs=True, stored_layers=2)) as step:
            assert (step.walks, step.listed, step.stored, step.graphs) == (False, 0, 0, None)
            assert not any(f.stored for f, _ in _patched(model))
            assert "parameters" not in model.__dict__ and _listed(model) == [None] * _LAYERS


def test_a_switch_of_mode_keeps_the_pass_the_kernels_read(model):
    """packed_sft's downshift re-enables checkpointing with the handle's `layer_pass`: kernels patched at
    attach_lora, holding that object, then see the new layers' first pass and recompute."""
    seen: list[str | None] = []
    first = enable_checkpointing(model, True)
    layer_pass = first.layer_pass
    first.undo()
    mlp = model.get_base_model().model.layers[0].mlp
    hook = mlp.register_forward_pre_hook(lambda *_: seen.append(layer_pass()))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with enable_checkpointing(model, "unsloth", layer_pass) as handle:
        assert handle.layer_pass is layer_pass
        model(input_ids=ids, labels=ids).loss.backward()
    hook.remove()
    assert seen == ["first", "recompute"] and layer_pass() is None
