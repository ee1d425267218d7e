"""`walks_from_lists`: the same answers as the model's class for train/eval, parameters and zero_grad, and
nothing left on the model afterwards."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimtune.models.tiny import build_model
from slimtune.train.step.walks import walks_from_lists


@pytest.fixture
def model():
    base = build_model("llama", 64, num_hidden_layers=2)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])).train()


def _flags(model) -> list[bool]:
    return [m.training for m in model.modules()]


def test_train_and_eval_set_every_flag_as_the_class_does(model):
    attention = model.get_base_model().model.layers[1].self_attn  # a submodule put in eval on its own
    with walks_from_lists(model) as listed:
        assert listed
        model.eval()
        assert not any(_flags(model))
        model.train()
        assert all(_flags(model))
        attention.eval()
        assert model.train() is model  # returns the model, as nn.Module.train does
        assert all(_flags(model))  # the one module out of step was noticed and set back
        with pytest.raises(ValueError):
            model.train("yes")  # the class's own check still runs when something would change
    assert all(_flags(model))


def test_parameters_and_zero_grad_match_the_class(model):
    expected = list(model.parameters())
    out = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]]))
    out.loss.backward()
    with_grad = [p for p in expected if p.grad is not None]
    assert with_grad
    with walks_from_lists(model):
        assert list(model.parameters()) == expected
        assert list(model.parameters(recurse=False)) == list(type(model).parameters(model, recurse=False))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        assert torch.isclose(norm, torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in with_grad])))
        model.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in with_grad)
        model.zero_grad()
        assert all(p.grad is None for p in expected)


def test_nothing_stays_on_the_model_even_after_an_error(model):
    with pytest.raises(RuntimeError, match="out of memory"):
        with walks_from_lists(model):
            assert {"train", "parameters", "zero_grad"} <= model.__dict__.keys()
            raise RuntimeError("out of memory")
    assert not {"train", "parameters", "zero_grad"} & model.__dict__.keys()


class _OwnTrain(torch.nn.Linear):
    def train(self, mode: bool = True):  # e.g. a module that re-freezes itself on every call
        return super().train(False)


def test_a_module_with_its_own_train_turns_the_shortcut_off(model):
    model.get_base_model().model.layers[0].extra = _OwnTrain(2, 2)
    with walks_from_lists(model) as listed:
        assert not listed
        assert "train" not in model.__dict__
        model.train()
    assert not model.get_base_model().model.layers[0].extra.training  # its own train ran
