"""benchmarks/moe_reference.py: the bf16-expert reference swaps each layer's NF4 experts for the checkpoint's own
matrices, so that it computes what transformers' experts compute, not the NF4 model's numbers."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.moe_reference import dense_experts
from slimtune.kernels.nf4_experts import quantize_model_experts
from slimtune.models.tiny import save_tiny


def _outputs(model: torch.nn.Module, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's experts on the same tokens, each token routed to experts 1 and 3 (weights 0.7 and 0.3)."""
    index = torch.tensor([[1, 3]]).expand(hidden.shape[0], 2)
    weights = torch.tensor([[0.7, 0.3]]).expand(hidden.shape[0], 2)
    with torch.no_grad():
        return [layer.mlp.experts(hidden, index, weights) for layer in model.model.layers]


def test_dense_experts_compute_what_transformers_experts_compute(tmp_path):
    for family in ("qwen3_moe", "gpt_oss"):  # per-expert checkpoint keys; fused ones
        model_dir = save_tiny(tmp_path / family, family)
        hidden = torch.randn(12, AutoConfig.from_pretrained(model_dir).hidden_size)
        expected = _outputs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), hidden)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert quantize_model_experts(model, torch.float32) == len(expected)
        quantized = _outputs(model, hidden)
        assert dense_experts(model, model_dir, torch.float32) == len(expected)
        for ours, nf4, theirs in zip(_outputs(model, hidden), quantized, expected):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            assert (nf4 - theirs).abs().max() > 100 * (ours - theirs).abs().max()  # the NF4 model's numbers differ
