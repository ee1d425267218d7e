"""Qwen3-MoE to GGUF, checked in llama.cpp: the per-expert tensors stacked into llama.cpp's `ffn_*_exps` in expert
order, the expert hyper-parameters, f16 and q8_0 logits against the HF model, and the configs llama.cpp refuses."""

from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_checks import PROMPTS, argmax_agreement

from slimtune.export import convert_hf_to_gguf, quantize_gguf, verify_gguf
from slimtune.export.gguf_experts import expert_stacks
from slimtune.export.gguf_verify import load_llama
from slimtune.models.family_configs import qwen3_moe_check
from slimtune.models.tiny import ensure_pretrained

Q = gguf.GGMLQuantizationType
_PROJECTIONS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")  # a guard only: CI installs slimtune[llama-cpp]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """The tiny qwen3_moe (hidden 256, 8 experts of width 256, top-2, 4 layers) after `pretrain`'s 150 steps (a
    random init's near-uniform logits flip the next token on any rounding): the cached model
    tests/test_gguf_quant_verify.py holds to the families' bars, saved again in bf16 as a merge writes it. bf16 ->
    f16 is exact, so the f16 file holds HF's weights and its logit error is llama.cpp's arithmetic alone. Saved
    by transformers 5 as the Hub ships it, one tensor per expert and projection."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = ensure_pretrained("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def _layers(model_dir: Path) -> range:
    return range(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


@pytest.fixture(scope="module")
def ggufs(moe_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[str, Path] = {}

    def get(out_type: str) -> Path:
        if out_type not in cache:
            [cache[out_type]] = convert_hf_to_gguf(moe_dir, root / f"moe-{out_type}.gguf", out_type)
        return cache[out_type]

    return get


def test_experts_are_stacked_in_expert_order(moe_dir, ggufs):
    from safetensors import safe_open

    reader = gguf.GGUFReader(ggufs("f16"))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["qwen3moe.expert_count"] == 8 and fields["qwen3moe.expert_used_count"] == 2
    assert fields["qwen3moe.expert_feed_forward_length"] == 256
    tensors = {t.name: t for t in reader.tensors}
    assert not [n for n in tensors if "experts" in n]
    [file] = moe_dir.glob("*.safetensors")
    with safe_open(file, framework="pt") as f:
        for layer in _layers(moe_dir):
            router = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
            # the router stays f32 in every file type, as llama.cpp's converter keeps it
            assert Q(router.tensor_type) == Q.F32
            assert np.array_equal(router.data, f.get_tensor(f"model.layers.{layer}.mlp.gate.weight").float().numpy())
            for hf, name in _PROJECTIONS.items():
                stacked = tensors[f"blk.{layer}.{name}.weight"]
                # llama.cpp's ne: {n_embd, n_ff_exp, n_expert} for gate/up, {n_ff_exp, n_embd, n_expert} for down
                assert list(stacked.shape) == [256, 256, 8] and Q(stacked.tensor_type) == Q.F16
                for e in range(8):  # bf16 -> f16 is exact: each slice is that expert's matrix, bit for bit
                    want = f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight").half().numpy()
                    assert np.array_equal(stacked.data[e], want), (layer, hf, e)


def test_experts_split_over_shards_give_the_same_file(moe_dir, ggufs, tmp_path):
    """A sharded checkpoint (1 MB shards: each layer's experts spread over several files) converts to the same
    tensors as the single file."""
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16).save_pretrained(sharded, max_shard_size="1MB")
    assert len(list(sharded.glob("*.safetensors"))) > 4
    [path] = convert_hf_to_gguf(sharded, tmp_path / "sharded.gguf", "f16")
    ours = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    single = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(ggufs("f16")).tensors}
    assert ours.keys() == single.keys() and all(np.array_equal(ours[n], single[n]) for n in single)


def test_conversion_holds_one_stacked_tensor_at_a_time(moe_dir, ggufs, tmp_path):
    ggufs("f16")  # a first conversion imports the tokenizer libraries, which tracemalloc would count
    stacked = 8 * 256 * 256 * 4  # one layer's gate, up or down experts in f32: 2 MiB; all six stacks: 12 MiB
    tracemalloc.start()
    try:
        convert_hf_to_gguf(moe_dir, tmp_path / "m.gguf", "q8_0")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # measured 3.4 MiB: the f32 stack, its q8_0 bytes and one expert's f32 copy; holding a layer's three
    # stacks (or the model's experts) would pass 6 MiB
    assert peak < 2.5 * stacked, peak


def test_f16_gguf_matches_hf(llama_cpp, moe_dir, ggufs):
    report = verify_gguf(ggufs("f16"), moe_dir, PROMPTS)
    assert report["token_ids_equal"] and report["positions"] > 150, report
    # The weights are exact (bf16 checkpoint); ggml rounds activations to f16 before f16 matmuls (2^-11
    # relative): measured 0.023 max over 180 positions, every next token HF's (2026-11-27). A router picking
    # another expert, or an expert's rows in the wrong order, moves logits by whole units.
    assert 1e-6 < report["max_abs_logit_diff"] < 0.1, report
    assert report["argmax_agreement"] == 1.0, report


def test_q8_0_gguf_picks_hf_next_token(llama_cpp, moe_dir, ggufs):
    path = ggufs("q8_0")
    types = {t.name: Q(t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    assert all(types[f"blk.{i}.{name}.weight"] == Q.Q8_0 for i in _layers(moe_dir) for name in _PROJECTIONS.values())
    assert all(types[f"blk.{i}.ffn_gate_inp.weight"] == Q.F32 for i in _layers(moe_dir))
    report = verify_gguf(path, moe_dir, PROMPTS)
    assert report["token_ids_equal"], report
    # Measured 2026-11-27: 177 of 180 positions (98.3%), largest logit error 2.87. 8-bit experts also flip the
    # router's choice where its top-k probabilities nearly tie, which moves that position's logits by units.
    assert report["argmax_agreement"] >= 0.98, report
    assert report["max_abs_logit_diff"] > 1e-3, report  # 8-bit weights really moved the logits


def _hf_with_gguf_weights(model_dir: Path, path: Path):
    """The HF model with every weight replaced by the GGUF's dequantized tensor, each stacked expert tensor split
    back into transformers' fused 3-D parameters (gate_up_proj: gate rows then up rows per expert)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, model.config.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def weight(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), Q(t.tensor_type)).astype(np.float32))

    state = {}
    for key, param in model.state_dict().items():
        layer = key.split(".")[2] if key.startswith("model.layers.") else ""
        if key.endswith("experts.gate_up_proj"):
            value = torch.cat(
                [weight(f"blk.{layer}.ffn_gate_exps.weight"), weight(f"blk.{layer}.ffn_up_exps.weight")], 1
            )
        elif key.endswith("experts.down_proj"):
            value = weight(f"blk.{layer}.ffn_down_exps.weight")
        else:
            value = weight(name_map.get_name(key, try_suffixes=(".weight", ".bias")))
        state[key] = value.reshape(param.shape)
    model.load_state_dict(state)
    return model


def test_k_quant_experts_run_in_llama_cpp(llama_cpp, moe_dir, ggufs, tmp_path):
    """llama.cpp's own quantizer on the f16 file puts k-quants on the 3-D expert tensors (rows of 256), and
    llama.cpp's logits follow those bytes: the HF model with the file's dequantized weights picks the same token."""
    from transformers import AutoTokenizer

    path = quantize_gguf(ggufs("f16"), tmp_path / "moe-q4_k_m.gguf", "q4_k_m")
    types = {t.name: Q(t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    experts = {types[f"blk.{i}.{name}.weight"] for i in _layers(moe_dir) for name in _PROJECTIONS.values()}
    assert experts <= {Q.Q4_K, Q.Q6_K}
    reference = _hf_with_gguf_weights(moe_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    llm = load_llama(path)
    agreement = argmax_agreement(llm, reference, tokenizer)
    llm.close()
    # Measured 2026-11-27: 177 of 180 (98.3%, q6_k the same); the rest is llama.cpp quantizing activations to 8 bits
    # for k-quant dot products, which flips the router's top-2 where probabilities nearly tie
    assert agreement >= 0.95, agreement


_RELEASED = {  # Qwen3-30B-A3B's routing config (its sizes do not matter to the check)
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
}


@pytest.mark.parametrize(
    "change,message",
    [
        ({}, None),
        ({"mlp_only_layers": [0, 47]}, r"dense MLP layers \[0, 47\]"),
        ({"decoder_sparse_step": 2}, r"dense MLP layers \[0, 2, 4"),
        ({"num_experts": 0}, "dense MLP layers all"),
        ({"norm_topk_prob": False}, "norm_topk_prob is false"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ],
)
def test_check_refuses_what_llama_cpp_cannot_run(change, message):
    problem = qwen3_moe_check({**_RELEASED, **change})
    assert problem is None if message is None else re.search(message, problem or ""), problem


def test_incomplete_experts_are_refused():
    keys = [
        (Path("m.safetensors"), k, k) for k in (f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in (0, 1, 3))
    ]
    with pytest.raises(ValueError, match=r"experts\.up_proj\.weight: the checkpoint has 3 experts .* the config 4"):
        expert_stacks(keys, 4)
    with pytest.raises(ValueError, match="indices 0-3"):
        expert_stacks(keys, None)  # a gap, whatever the config says
    stacks = expert_stacks(keys[:2], 2)
    assert set(stacks) == {k for _, k, _ in keys[:2]}
    assert stacks[keys[0][1]].key == "model.layers.0.mlp.experts.up_proj.weight"
