"""Eval then train: an eval pass (eval mode, no grad) must leave every family's 4-bit layers trainable as before.

bitsandbytes 0.50.2 repacks a CPU 4-bit weight for inference on its first eval-mode forward without grad
(on CPUs with AVX512-BF16); the next training step then fails for biased layers (Qwen2) or silently loses
the gradient through the base weights (the others). See `slimtune.tasks.load_4bit.keep_training_layout`.
"""

from __future__ import annotations

import pytest
import torch

from slimtune.core import registry
from slimtune.models.families import FAMILIES
from slimtune.models.tiny import save_tiny
from slimtune.spec.schema import ModelSpec, PipelineSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.load_4bit import load_4bit


def _grads(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.fault(
    "Eval pass before training (CPU)",
    stage="packed_sft",
    expect="every family trains after an eval pass, with the same loss and LoRA gradients as without it",
)
@pytest.mark.parametrize("family", FAMILIES)
def test_eval_then_train_gives_the_same_gradients(family, tmp_path, observe):
    spec = PipelineSpec()
    spec.model = ModelSpec(name_or_path=str(save_tiny(tmp_path / family, family)), device="cpu")
    spec.lora.gradient_checkpointing = False
    spec.lora.dropout = 0.0
    model = registry.get(attach_lora(spec, load_4bit(spec).handle).handle)
    torch.manual_seed(0)
    ids = torch.randint(0, 800, (2, 32))
    # lora_B starts at zero, so lora_A gets no gradient until B moves: one step makes every gradient non-zero
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    loss_before, before = _grads(model, ids)
    model.eval()
    with torch.no_grad():  # what Trainer's evaluate does
        model(input_ids=ids, labels=ids)
    loss_after, after = _grads(model, ids)
    worst = max((after[n] - before[n]).abs().max().item() for n in before)
    observe(f"{family}: loss {loss_before:.6f} then {loss_after:.6f}; largest LoRA gradient change {worst:.1e}")
    assert loss_after == pytest.approx(loss_before, abs=1e-6)
    # The same kernels on the same inputs: only summation order may differ (fp32, tiny magnitudes)
    assert worst < 1e-6
