"""What one decoder layer keeps per token for backward: the counts `slimtune.memory.estimate` multiplies by the
tokens of a step and by the layers that keep them (stored, or the one being recomputed)."""

from __future__ import annotations

from slimtune.memory.model_shape import ModelShape

# A Gated DeltaNet layer (Qwen3.5), counted as every layer keeping that much more than the model's attention layer.
# Eager on the CPU it saves 1.8x (678 vs 380 KB per token at Qwen3.5-4B's widths, saved-tensor hooks:
# benchmarks/deltanet_activations.py; 2.3x on the tiny); on a GPU the mixer runs compiled
# (slimtune.train.step.deltanet_mixer), whose backward recomputes its element-wise parts and saves less. On an
# H200 (4 x 2048, all 32 layers stored) the compiled mixer held 66.98 GiB of the card, where 1.8x estimated 83.2
# (1.24x) and 1.5x estimates 70.2 (1.05x): benchmarks/results/families/h200-2026-11-27c-qwen35-issue42.md.
LINEAR_ATTENTION_ACTIVATIONS = 1.5
# Eager attention (gpt-oss, whose sinks keep transformers' eager path) keeps one 16-bit softmax of every head's
# scores (heads x seq x seq+1 per row) for backward; recomputing a layer holds it, the gradient of the scores, that of
# the sink-extended logits and the logits themselves: 4 of them. The GPU run that needed this term: gpt-oss-20b at
# 1 x 2048 under 16 GiB (H200, 2026-11-27) ran out of memory allocating one 512 MiB score tensor past the estimate.
EAGER_SCORES_RECOMPUTE = 4


def bytes_per_token_layer(shape: ModelShape, dtype_bytes: int, targets: list[str], lora_r: int) -> int:
    """Bytes autograd keeps per token for one decoder layer of a QLoRA model without checkpointing.

    Counted from what each op saves for backward under bf16 autocast with float32 adapters (peft's
    default), LoRA dropout 0 and SDPA with native GQA, and checked against saved-tensor hooks on a
    tiny Llama (tests/test_memory_estimate.py):
    - every LoRA module keeps its own 16-bit copy of its input (autocast casts peft's float32 view
      of the input back down for the matmul), plus its rank-r intermediate;
    - SDPA keeps RoPE'd q, k, v and its output (2 q_dim + 2 kv_dim);
    - the MLP keeps gate, SiLU(gate) and up (3 i); the frozen NF4 matmuls keep only their weights;
    - each of the two RMSNorms keeps a float32 copy of its input (2 x 4 h bytes).
    Llama-3.1-8B, all seven projections: 212 KiB per token-layer; with logits that predicts
    8.5 MB per token without checkpointing where the reference table measured 7.55 (+12%), and
    2.0 MB with checkpointing where it measured 2.07.
    """
    projections = shape.projections()
    lora_inputs = sum((projections[t][0] + lora_r) * shape.routed(t) for t in targets)
    mlp = 3 * shape.intermediate * shape.routed("gate_proj")  # an MoE token: each of its experts' MLP
    elements = mlp + 2 * shape.q_dim + 2 * shape.kv_dim + lora_inputs
    return elements * dtype_bytes + 2 * 4 * shape.hidden


def varlen_bytes_per_token_layer(shape: ModelShape, dtype_bytes: int) -> int:
    """What packed rows through `slimtune.train.step.attention.VARLEN` keep per token and layer beyond the count
    above, with the in-place RoPE kernel.

    Measured on an H100 (1B, 8B and Qwen 7B shapes, every checkpointing mode, 2048-32768 tokens): with the
    kernels on, allocated peaks rose by exactly one 16-bit q, k and v per token-layer over the same cells
    through SDPA (8B: 768 MiB at 1 x 2048 without checkpointing, 24 MiB with it); with the kernels off
    (eager RoPE) they did not change. Which tensor it is was not isolated.

    Since varlen attention calls aten's flash kernel directly (k/v no longer repeated to every head, no
    custom op), the product's peaks fell by about this term for one layer (H100, 2026-11-23, the README's
    table against the one before it: 8B 1 x 16384 with "unsloth" checkpointing 8.26 -> 8.08 GiB, the term
    192 MiB; 1B 4 x 2048 2.07 -> 2.02 GiB, the term 48 MiB). Kept until the calibration is measured again
    (benchmarks/calibrate_memory.py): until then it overestimates by that much, on the safe side.
    """
    return (shape.q_dim + 2 * shape.kv_dim) * dtype_bytes


def eager_scores_bytes_per_token_layer(shape: ModelShape, seq_len: int, dtype_bytes: int) -> int:
    """One row's 16-bit attention scores per token, for attention that materializes them (`ModelShape.eager_attention`):
    heads x seq per query; 0 where attention runs without them (SDPA, flash)."""
    return shape.heads * seq_len * dtype_bytes if shape.eager_attention else 0
