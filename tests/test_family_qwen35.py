"""Qwen3.5 text (hybrid Gated DeltaNet + gated full attention) through every stage on the CPU.

The tiny qwen3_5_text has the released layer pattern (three linear-attention layers, then one full-attention
layer) and twice as many value heads as key heads in its DeltaNet, as the released checkpoints.
"""

from __future__ import annotations

import json

import bitsandbytes as bnb
import numpy as np
import pytest
import torch
import yaml
from tiny_flows import tiny_flow_spec

from slimtune.cli.main import main
from slimtune.core import registry
from slimtune.data import RowCollator, load_examples, one_per_row, pack
from slimtune.data.formats import IGNORE_INDEX
from slimtune.export import convert_hf_to_gguf, verify_gguf
from slimtune.export.gguf_verify import llama_cpp_logits, load_llama
from slimtune.merge import merge_adapter
from slimtune.models.families import FAMILIES, check_architecture
from slimtune.models.tiny import DATA_FILE, build_model, build_tokenizer, ensure_pretrained, save_tiny
from slimtune.spec.schema import DataSpec, ModelSpec, PipelineSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.load_4bit import load_4bit
from slimtune.train.options import choose_batching

PATTERN = ["linear_attention"] * 3 + ["full_attention"]
PROMPTS = ["<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n", "The quick brown fox " * 6]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """The tiny model with its frozen DeltaNet parameters and norms moved off their init, so that a converter
    that skipped a transform (A = -exp(A_log), the dt bias, the norm offsets) would be caught."""
    model = build_model("qwen3_5_text", len(tokenizer))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    out = tmp_path_factory.mktemp("qwen35") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_model(model_dir):
    """The NF4-loaded tiny with the family's LoRA attached (slimtune's own load_4bit and attach_lora)."""
    spec = PipelineSpec()
    spec.model = ModelSpec(name_or_path=str(model_dir), device="cpu")
    spec.lora.gradient_checkpointing = False
    spec.lora.dropout = 0.0
    loaded = load_4bit(spec)
    lora = attach_lora(spec, loaded.handle)
    yield loaded, lora, registry.get(lora.handle)
    registry.release_all()


def test_tiny_model_has_the_hybrid_layer_pattern(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["layer_types"] == PATTERN
    assert config["linear_num_value_heads"] == 2 * config["linear_num_key_heads"]
    assert check_architecture(config) is None


@pytest.mark.parametrize(
    "overrides,problem",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
        ({"layer_types": ["full_attention"] + ["linear_attention"] * 3}, "layer_types differ"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope scaling 'yarn'"),
    ],
)
def test_configs_llama_cpp_cannot_run_are_refused_in_one_line(overrides, problem):
    config = build_model("qwen3_5_text", 64).config.to_dict()
    found = check_architecture({**config, **overrides})
    assert found is not None and problem in found and "\n" not in found, found


def test_validate_plan_and_init_accept_qwen35(tmp_path):
    model_dir = save_tiny(tmp_path / "qwen35", "qwen3_5_text")
    data = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    spec = tmp_path / "spec.yaml"
    fields = {"name": "q", "output_dir": str(tmp_path / "runs"), "model": {"name_or_path": str(model_dir)}}
    spec.write_text(yaml.safe_dump({**fields, "data": {"path": str(data)}}))
    assert main(["validate", str(spec)]) == 0
    assert main(["plan", str(spec), "--gpu-memory", "16GiB", "--host-memory", "16GiB"]) == 0
    assert main(["init", "--model", str(model_dir), "--data", str(data), "--gpu-memory", "16GiB"]) == 0


def test_nf4_load_and_lora_on_attention_deltanet_and_mlp(lora_model):
    loaded, lora, model = lora_model
    deltanet = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
    attention, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    # three DeltaNet layers (5 projections) and one attention layer (4), each with the MLP's 3; lm_head stays 16-bit
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert loaded.linear_4bit == len(linears) == 3 * (5 + 3) + (4 + 3)
    assert lora.target_modules == sorted(deltanet + attention + mlp)  # the spec's default seven reach the DeltaNet
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # conv1d, A_log, dt_bias and the norms stay frozen
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == set(deltanet + attention + mlp)


def _grads(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_eval_then_train_gives_the_same_gradients_and_training_lowers_the_loss(lora_model):
    _, _, model = lora_model
    ids = torch.randint(0, 800, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # lora_B starts at zero: moved, so that every LoRA weight gets a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    loss_before, before = _grads(model, ids)
    model.eval()
    with torch.no_grad():  # what Trainer's evaluate does
        model(input_ids=ids, labels=ids)
    loss_after, after = _grads(model, ids)
    assert loss_after == pytest.approx(loss_before, abs=1e-6)
    assert all(before[n].abs().max() > 0 for n in before)
    assert max((after[n] - before[n]).abs().max().item() for n in before) < 1e-6  # fp32 summation order only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _loss_sum_and_count(model, batch) -> tuple[float, int]:
    batch = {k: v for k, v in batch.items() if not k.startswith("_")}
    with torch.no_grad():
        loss = model(**batch).loss.double()
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return float(loss) * n, n


def test_packed_loss_equals_per_example_loss(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    examples = load_examples(DataSpec(path=str(DATA_FILE), max_seq_length=64, eval_fraction=0), tokenizer).train[:8]
    rows = pack(examples, 128)
    assert any(len(r.seq_lens) > 2 for r in rows)  # really packed
    alone = [_loss_sum_and_count(model, RowCollator("padded", 0)(one_per_row([e]))) for e in examples]
    expected = sum(s for s, _ in alone) / sum(n for _, n in alone)
    batch = RowCollator("packed", tokenizer.pad_token_id)(rows)
    # transformers' torch path runs the conv and the recurrence across the documents of a row (measured 1.4e-3
    # off on the random tiny), which choose_batching's per-document linear-attention layers remove
    leaked, count = _loss_sum_and_count(model, batch)
    assert abs(leaked / count - expected) > 1e-4
    assert choose_batching(model, "packed").mode == "packed"
    total, count = _loss_sum_and_count(model, batch)
    assert count == sum(n for _, n in alone)
    # fp32 end to end; 1e-5 is ~20x the difference measured here (4e-7)
    assert total / count == pytest.approx(expected, abs=1e-5)


def test_packed_gradients_equal_per_example_gradients(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").train()
    examples = load_examples(DataSpec(path=str(DATA_FILE), max_seq_length=48, eval_fraction=0), tokenizer).train[:3]
    [row] = pack(examples, sum(len(e.input_ids) for e in examples))
    choose_batching(model, "packed")
    weight = model.model.layers[0].linear_attn.in_proj_qkv.weight

    def grad(batch, count: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        batch = {k: v for k, v in batch.items() if not k.startswith("_")}
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        (model(**batch).loss * n / count).backward()
        return weight.grad.clone()

    count = sum(int((torch.tensor(e.labels[1:]) != IGNORE_INDEX).sum()) for e in examples)
    packed = grad(RowCollator("packed", tokenizer.pad_token_id)([row]), count)
    alone = sum(grad(RowCollator("padded", 0)(one_per_row([e])), count) for e in examples)
    assert packed.abs().max() > 0
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=1e-4)  # fp32 summation order


def test_packed_rows_run_each_deltanet_layer_in_one_call(model_dir, tokenizer, monkeypatch):
    """Several packed rows go through each Gated DeltaNet's mixer (conv, gates, delta rule, norm) in one call (not
    one per document), and still give the examples' own losses."""
    from transformers import AutoModelForCausalLM

    from slimtune.train.step import linear_attention

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    examples = load_examples(DataSpec(path=str(DATA_FILE), max_seq_length=48, eval_fraction=0), tokenizer).train[:8]
    rows = pack(examples, 96)
    assert len(rows) >= 2 and sum(len(r.seq_lens) for r in rows) >= 6
    calls = []
    mixer = linear_attention.gated_delta_mixer
    monkeypatch.setattr(linear_attention, "gated_delta_mixer", lambda *a: calls.append(1) or mixer(*a))
    choose_batching(model, "packed")  # the patch takes the mixer math it will call
    total, count = _loss_sum_and_count(model, RowCollator("packed", tokenizer.pad_token_id)(rows))
    assert len(calls) == 3  # the tiny's three DeltaNet layers, once each for the whole batch
    alone = [_loss_sum_and_count(model, RowCollator("padded", 0)(one_per_row([e]))) for e in examples]
    assert total / count == pytest.approx(sum(s for s, _ in alone) / sum(n for _, n in alone), abs=1e-5)


def test_deltanet_layers_keep_over_twice_an_attention_layers_activations(model_dir):
    """Why the estimate scales linear-attention models' layers (slimtune.memory.estimate: 1.8x eager and 1.5x
    compiled at Qwen3.5-4B's widths): on a packed bf16 forward of the tiny, a Gated DeltaNet layer saves for
    backward over twice the bytes the full-attention layer does (measured 2.2-2.3x)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    choose_batching(model, "packed")
    for name, p in model.named_parameters():
        p.requires_grad_("layers" in name and "proj" in name)
    current, saved = [None], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is not None:
            storages = saved.setdefault(current[0], {})
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None))
    position_ids = torch.cat([torch.arange(200), torch.arange(312)]).unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 200, (1, 512)), position_ids=position_ids)
    kept = {i: sum(storages.values()) for i, storages in saved.items()}
    types = model.config.layer_types
    attention = [kept[i] for i, t in enumerate(types) if t == "full_attention"]
    deltanet = [kept[i] for i, t in enumerate(types) if t == "linear_attention"]
    assert attention and deltanet and min(deltanet) > 2 * max(attention)


def test_merge_matches_peft_on_the_nf4_base(model_dir, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=list(FAMILIES["qwen3_5_text"].lora_targets))
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(2)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # non-zero, so that merging really changes the weights
            p.data = torch.randn(p.shape, generator=generator) * 0.05
    peft_model.save_pretrained(tmp_path / "adapter")
    report = merge_adapter(
        model_dir, tmp_path / "adapter", tmp_path / "merged", source="dequantized", output_dtype=torch.float32
    )
    assert report.tensors_merged == 3 * (5 + 3) + (4 + 3)
    nf4 = AutoModelForCausalLM.from_pretrained(
        model_dir,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        ),
        dtype=torch.float32,
    ).eval()
    for module in nf4.modules():  # the exact fp32 dequantization training and the merge use (tests/test_merge.py)
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    ids = torch.randint(0, nf4.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = nf4(ids).logits
        peft_logits = PeftModel.from_pretrained(nf4, tmp_path / "adapter").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        merged_logits = merged(ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapter moves the output
    assert torch.isfinite(merged_logits).all()
    # fp32 reassociation of x@W^T + s*(x@A^T)@B^T versus x@(W + s*B@A)^T; logits are O(1)
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-4, rtol=0)


def test_f32_gguf_matches_transformers(model_dir, tokenizer, tmp_path):
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    [path] = convert_hf_to_gguf(model_dir, tmp_path / "q.gguf", "f32")
    llm = load_llama(path)
    worst = 0.0
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            ref = model(torch.tensor([ids])).logits[0].numpy()
            worst = max(worst, float(np.abs(llama_cpp_logits(llm, ids) - ref).max()))
    llm.close()
    # op-order noise only (measured 1.5e-6 with logits up to 1.6); dropping the norm offsets, A = -exp(A_log) or
    # the value-head reorder moves the logits by far more
    assert worst < 1e-4, worst


def test_f16_gguf_in_llama_cpp(tmp_path):
    """f16 picks transformers' next token everywhere. q8_0 is checked with every family in
    tests/test_gguf_quant_verify.py::test_q8_0_gguf_picks_hf_next_token, where a flip must be a near-tie: a bare
    98% floor here failed on an AVX-512 machine's pretraining (93 of 99 positions)."""
    pytest.importorskip("llama_cpp")
    model_dir = ensure_pretrained("qwen3_5_text")  # peaked logits: slimtune.models.tiny.pretrain says why
    [path] = convert_hf_to_gguf(model_dir, tmp_path / "q-f16.gguf", "f16")
    report = verify_gguf(path, model_dir, PROMPTS)
    assert report["token_ids_equal"], report
    assert report["argmax_agreement"] == 1.0, report
    assert report["positions"] > 60


def test_flow_evaluates_trains_packed_merges_and_exports(prefect_harness, tmp_path):
    """The six tasks on the builtin tiny qwen3_5_text: eval before and after packed training, merge, f16 and q8_0
    GGUF verified in llama.cpp against the merged model (the flow's own check)."""
    pytest.importorskip("llama_cpp")
    from slimtune.flows.finetune import finetune

    spec = tiny_flow_spec("qwen3_5_text", tmp_path)
    assert finetune(spec, return_state=True).is_completed()
    report = json.loads((spec.run_dir() / "report.json").read_text())
    train = report["packed_sft"]
    assert train["batching"] == "packed" and train["batching_fallback"] is None
    assert train["eval_loss_after"] < train["eval_loss_before"]
    verification = report["gguf_convert_and_push"]["verification"]
    assert sorted(verification) == [f"{spec.name}-f16.gguf", f"{spec.name}-q8_0.gguf"]
    for result in verification.values():
        # the random-init builtin: near-uniform logits, so a few flips are chance (measured 100% for both)
        assert result["token_ids_equal"] and result["argmax_agreement"] >= 0.95, result
