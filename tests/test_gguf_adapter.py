"""The LoRA adapter GGUF in llama.cpp: base GGUF + adapter must compute what the merged model's GGUF computes.

Per family (llama permutes q/k rows, qwen2 has q/k/v biases, gemma a (1 + w) norm), with rsLoRA on one
of them: an adapter with random non-zero B is merged by peft, the base and the merged model are
converted to f32 GGUF, and llama.cpp's logits with the adapter are compared with the merged file's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from slimtune.export import convert_hf_to_gguf
from slimtune.export.gguf_adapter import adapter_alpha, convert_adapter_to_gguf, verify_adapter_gguf
from slimtune.models.tiny import build_model, build_tokenizer
from slimtune.tasks.gguf_convert_and_push import VERIFY_PROMPTS

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _base_adapter_merged(tmp_path, tokenizer, family: str, **lora):
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base"
    model = build_model(family, len(tokenizer))
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, **lora))
    g = torch.Generator().manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    tokenizer.save_pretrained(tmp_path / "merged")
    return base, tmp_path / "adapter", tmp_path / "merged"


@pytest.mark.parametrize(("family", "lora"), [("llama", {}), ("qwen2", {"use_rslora": True}), ("gemma", {})])
def test_base_plus_adapter_matches_merged_in_llama_cpp(tmp_path, tokenizer, family, lora):
    pytest.importorskip("llama_cpp")
    import gguf

    base, adapter, merged = _base_adapter_merged(tmp_path, tokenizer, family, **lora)
    config = json.loads((base / "config.json").read_text())
    path = convert_adapter_to_gguf(adapter, config, tmp_path / "x-lora.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.lora.alpha"].contents() == pytest.approx(16 * (math.sqrt(8) if lora else 1))
    base_gguf = convert_hf_to_gguf(base, tmp_path / "base.gguf", "f32")[0]
    merged_gguf = convert_hf_to_gguf(merged, tmp_path / "merged.gguf", "f32")[0]
    check = verify_adapter_gguf(base_gguf, path, merged_gguf, VERIFY_PROMPTS, tokenizer)
    assert check["argmax_agreement"] >= 0.99, check
    # f32 on both sides: only summation order differs (W x + B A x vs (W + B A) x). The adapter moves
    # the logits by far more than this (checked below), so a wrong layout or scale cannot pass.
    assert check["max_abs_logit_diff"] < 1e-3, check
    without = verify_adapter_gguf(base_gguf, path, base_gguf, VERIFY_PROMPTS, tokenizer)
    assert without["max_abs_logit_diff"] > 100 * check["max_abs_logit_diff"], (without, check)


def test_rslora_alpha_gives_llama_cpp_the_peft_scale():
    # llama.cpp scales by alpha / r; peft's rsLoRA by alpha / sqrt(r).
    assert adapter_alpha({"r": 16, "lora_alpha": 32, "use_rslora": True}) / 16 == pytest.approx(32 / 4)
    assert adapter_alpha({"r": 16, "lora_alpha": 32}) / 16 == pytest.approx(2)


def test_trained_embeddings_are_refused_with_the_field_to_change(tmp_path, tokenizer):
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 256),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(256, 8),
            "base_model.model.model.embed_tokens.weight": torch.zeros(4, 256),
        },
        tmp_path / "adapter_model.safetensors",
    )
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
    }
    with pytest.raises(ValueError, match="lora.train_embeddings: false"):
        convert_adapter_to_gguf(tmp_path, config, tmp_path / "x-lora.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))
