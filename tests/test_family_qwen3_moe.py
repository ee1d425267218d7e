"""Qwen3-MoE through the product: NF4 experts with their own LoRA, the flow end to end, the estimates, refusals.

The experts' NF4 and LoRA math is tests/test_nf4_experts.py's, the GGUF tests/test_gguf_qwen3_moe.py's; the family
table's matrix (load, checkpointing, merge against the NF4 model, kernels) runs qwen3_moe with every other family.
"""

from __future__ import annotations

import json

import pytest
from tiny_flows import tiny_flow_spec

from slimtune.checks.problems import spec_problems
from slimtune.memory.estimate import estimate_load_4bit, estimate_train
from slimtune.models.tiny import DATA_FILE, save_tiny
from slimtune.spec.schema import PipelineSpec

# Qwen3-30B-A3B's config.json (the Hub's keys: num_experts, not transformers 5's num_local_experts)
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
_GIB = 1024**3


def test_estimates_count_every_expert_and_route_each_token_through_k():
    cfg, h, e, i, layers = QWEN3_30B_A3B, 2048, 128, 768, 48
    attention = h * 32 * 128 * 2 + h * 4 * 128 * 2  # q, o and k, v
    experts = e * 3 * h * i
    load = estimate_load_4bit(cfg, compute_dtype_bytes=2)
    nf4 = load.breakdown["gpu: nf4 linears"]
    # NF4 with double quantization: half a byte per weight, one absmax byte per 64, a float per 256 of those
    per_weight = 0.5 + 1 / 64 + 4 / (64 * 256)
    assert nf4 == pytest.approx(layers * (attention + experts) * per_weight, rel=2e-3)
    assert 14.3 < nf4 / _GIB < 14.5  # 29.9e9 weights in the layers: 14.4 GiB, which a 24 GiB card holds
    # bitsandbytes leaves the experts in 16 bits; load_4bit reads and quantizes them one layer at a time (1.1 GiB)
    assert load.breakdown["gpu: load transient (one layer's experts in 16 bits until quantized)"] == experts * 2
    # and quantizing them works on chunks of whole experts under 2^26 weights: 42 of 768 x 2048 (measured 1.06 GiB)
    assert load.breakdown["gpu: load transient (quantizing a chunk of experts)"] == 18 * 42 * i * h
    assert 18.3 < load.gpu_bytes / _GIB < 18.6  # a 24 GiB card loads it (all 48 layers' experts at once: 70.7 GiB)
    kwargs = dict(micro_batch=1, seq_len=2048, lora_r=16, checkpointing="unsloth", kernels=())
    seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    train = estimate_train(cfg, target_modules=seven, **kwargs)
    attention_only = estimate_train(cfg, target_modules=seven[:4], **kwargs)
    lora = (
        train.breakdown["gpu: lora weights and grads (fp32)"]
        - attention_only.breakdown["gpu: lora weights and grads (fp32)"]
    )
    assert lora == layers * e * 16 * (3 * h + 3 * i) * 8  # every expert's gate, up and down: fp32 weight and grad
    # the grouped GEMMs dequantize 256 MiB of gate_up experts at once (42 of 2 x 768 x 2048 in bf16), and the
    # separately stored gate and up are stacked into that chunk: twice it while both are held
    assert train.breakdown["gpu: a chunk of experts dequantized (grouped matmul)"] == 2 * 42 * 2 * i * h * 2
    # a token's activations go through its 8 experts (not 1, not all 128): each more expert keeps its MLP's gate,
    # activation and up (3 i) and its LoRA inputs (gate, up: h + r; down: i + r), 16-bit, per token and layer
    stored = "gpu: activations (no checkpointing)"
    kwargs["checkpointing"] = False
    eight = estimate_train(cfg, target_modules=seven, **kwargs).breakdown[stored]
    one = estimate_train({**cfg, "num_experts_per_tok": 1}, target_modules=seven, **kwargs).breakdown[stored]
    per_expert = 3 * i + 2 * (h + 16) + (i + 16)
    assert eight - one == 7 * per_expert * 2 * 2048 * layers


def _problems(tmp_path, **changes) -> list[str]:
    spec = PipelineSpec.model_validate(
        {
            "output_dir": str(tmp_path),
            "model": {"name_or_path": "builtin:tiny-qwen3_moe", "device": "cpu"},
            "data": {"path": str(DATA_FILE)},
            **changes,
        }
    )
    return spec_problems(spec)


def test_validate_refuses_what_the_nf4_experts_do_not_do_yet(tmp_path):
    assert _problems(tmp_path) == []
    [fsdp] = _problems(
        tmp_path, train={"num_gpus": 2, "parallelism": "fsdp"}, model={"name_or_path": "builtin:tiny-qwen3_moe"}
    )
    assert fsdp.startswith("train.parallelism: fsdp does not shard a mixture-of-experts model's NF4 experts")
    [adapter] = _problems(tmp_path, export={"adapter_gguf": True})
    assert adapter.startswith("export.adapter_gguf: the LoRA GGUF of a mixture-of-experts model")


def test_validate_refuses_pickle_weights_of_a_mixture_of_experts(tmp_path):
    """load_4bit reads the experts from safetensors shards: a pickle-only checkpoint (allow_pickle) is named."""
    import torch
    from safetensors.torch import load_file

    model_dir = save_tiny(tmp_path / "moe", "qwen3_moe")
    [weights] = model_dir.glob("*.safetensors")
    torch.save(load_file(weights), model_dir / "pytorch_model.bin")
    weights.unlink()
    [pickle] = _problems(tmp_path, model={"name_or_path": str(model_dir), "device": "cpu", "allow_pickle": True})
    assert pickle == (
        f"model.name_or_path: {model_dir} holds its weights in pickle files, and load_4bit reads a mixture-of-experts "
        "model's experts from safetensors shards, one layer at a time; save the model as safetensors "
        "(transformers' save_pretrained does by default)"
    )


def test_flow_trains_the_experts_merges_and_exports(prefect_harness, tmp_path):
    """The six tasks on the builtin tiny qwen3_moe: LoRA on attention and on every expert, eval before and after
    packed training, the merge of every expert matrix, f16 and q8_0 GGUF verified in llama.cpp (the flow's check)."""
    pytest.importorskip("llama_cpp")
    from safetensors.torch import load_file

    from slimtune.flows.finetune import finetune

    spec = tiny_flow_spec("qwen3_moe", tmp_path)
    assert finetune(spec, return_state=True).is_completed()
    report = json.loads((spec.run_dir() / "report.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(report["attach_lora"]["target_modules"])
    train = report["packed_sft"]
    assert train["batching"] == "packed" and train["eval_loss_after"] < train["eval_loss_before"]
    adapter = load_file(spec.run_dir() / "adapter" / "adapter_model.safetensors")
    assert sum(".mlp.experts." in k for k in adapter) == 4 * 8 * 3 * 2  # layers x experts x projections x (A, B)
    assert report["dequant_merge"]["tensors_merged"] == 4 * (4 + 8 * 3)  # attention and every expert matrix
    verification = report["gguf_convert_and_push"]["verification"]
    assert sorted(verification) == [f"{spec.name}-f16.gguf", f"{spec.name}-q8_0.gguf"]
    f16, q8 = verification[f"{spec.name}-f16.gguf"], verification[f"{spec.name}-q8_0.gguf"]
    assert f16["token_ids_equal"] and f16["argmax_agreement"] >= 0.95, f16
    # the random-init builtin routes near ties: q8_0's rounding flips an expert choice now and then (measured 0.886
    # of 35 positions); tests/test_gguf_qwen3_moe.py holds a pretrained model's q8_0 to 98%
    assert q8["token_ids_equal"] and q8["argmax_agreement"] >= 0.8, q8


def test_init_says_the_mlp_names_are_every_experts(tmp_path):
    """`slimtune init` on Qwen3-30B-A3B's config: the proposed targets' comment says what they train there."""
    from slimtune.cli.scaffold import scaffold_spec
    from slimtune.models.tiny import build_tokenizer

    model = tmp_path / "qwen3-30b-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    build_tokenizer().save_pretrained(model)
    text = scaffold_spec(str(model), str(DATA_FILE), gpu_memory=80 * _GIB)
    [targets] = [line for line in text.splitlines() if line.strip().startswith("target_modules:")]
    assert "gate_proj, up_proj, down_proj]" in targets and "each of the 128 experts in every layer" in targets


def test_a_config_with_another_expert_count_is_named_before_loading(tmp_path):
    """The model-files check compares the checkpoint's per-expert tensors with the fused parameters the config
    builds: a config.json of another expert count is refused naming the tensor, both shapes and the field."""
    from slimtune.checks.model_files import weight_file_problems
    from slimtune.checks.problems import meta_model
    from slimtune.models.tiny import save_tiny
    from slimtune.spec.schema import ModelSpec

    model = save_tiny(tmp_path / "moe", "qwen3_moe")
    assert weight_file_problems(ModelSpec(name_or_path=str(model)), model, meta_model(model)) == []
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_local_experts": 16}))
    [problem] = weight_file_problems(ModelSpec(name_or_path=str(model)), model, meta_model(model))
    assert "model.layers.0.mlp.experts.gate_up_proj is [8, 512, 256] in model.safetensors" in problem
    assert "but [16, 512, 256] from config.json (config.json num_local_experts: 16, the weights say 8?)" in problem
