"""Text fine-tuning of a Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration, as Gemma-3-4B/12B/27B).

One tiny run shared by every test: the pretrained tiny gemma3_text as the language model of a multimodal checkpoint
with a random one-layer SigLIP tower, saved as transformers saves the layout (`language_model.model.*`,
`vision_tower.*`, `multi_modal_projector.*`); then load_4bit, attach_lora, packed_sft (eval, train, eval),
dequant_merge and the GGUF converter, as the flow runs them. Mistral 3's layout (Mistral-Small-3.1/3.2) goes through the
same stages, less the training run, in the last test.
"""

from __future__ import annotations

import json
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
import yaml
from checkpoint_files import checkpoint_tensors
from peft import PeftModel
from random_adapter import merge_random_adapter
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma4ForConditionalGeneration,
    Mistral3ForConditionalGeneration,
    Qwen3_5ForConditionalGeneration,
)

from slimtune.cli.main import EXIT_INVALID_SPEC, main
from slimtune.core import registry
from slimtune.data import RowCollator, one_per_row, pack
from slimtune.data.collator import IGNORE_INDEX
from slimtune.export import convert_hf_to_gguf, verify_gguf
from slimtune.merge.nf4 import TRAINING_NF4, quantized_tensor_names
from slimtune.models.families import check_architecture
from slimtune.models.multimodal import LAYOUTS, checkpoint_names, copied_bytes, text_key, text_model_load_kwargs
from slimtune.models.tiny import DATA_FILE, ensure_pretrained, save_tiny_multimodal
from slimtune.plan.fit import Budget, plan, stored_tensor_bytes
from slimtune.spec.schema import DataSpec, ModelSpec, PipelineSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.dequant_merge import dequant_merge
from slimtune.tasks.load_4bit import load_4bit
from slimtune.tasks.packed_sft import packed_sft, prepare_data
from slimtune.train import choose_batching

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog, then counts 1, 2, 3 and 45678 sheep.",
    "Explain gradient descent to a beginner in two sentences, with an example.",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    # the pretrained tiny (peaked logits, so that next-token agreement says something about the GGUF) with
    # Gemma's SentencePiece-style tokenizer, as the released checkpoints have
    return save_tiny_multimodal(tmp_path_factory.mktemp("gemma3") / "base", ensure_pretrained("gemma3_text", "gemma"))


def _spec(base: Path, root: Path) -> PipelineSpec:
    data = root / "chat.jsonl"
    data.write_text("\n".join(DATA_FILE.read_text(encoding="utf-8").splitlines()[:24]) + "\n", encoding="utf-8")
    spec = PipelineSpec(name="mm", output_dir=str(root / "runs"))
    spec.model = ModelSpec(name_or_path=str(base), device="cpu")
    spec.data = DataSpec(path=str(data), max_seq_length=128, eval_fraction=0.1)
    spec.lora.dropout = 0.0
    spec.train.learning_rate, spec.train.max_steps, spec.train.warmup_steps = 5e-3, 3, 1
    return spec


@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    """The flow's stages on the multimodal checkpoint, once; what each left behind, for the tests to check."""
    spec = _spec(base, tmp_path_factory.mktemp("run"))
    try:
        examples = prepare_data(spec, str(base))
        loaded = load_4bit(spec)
        model = registry.get(loaded.handle)
        names = [n for n, _ in model.named_parameters()]
        linear_4bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
        losses = _packed_and_alone(model, *registry.get(examples))
        lora = attach_lora(spec, loaded.handle)
        report = packed_sft(
            spec,
            lora.handle,
            lora.checkpointing_handle,
            examples,
            micro_batch_size=2,
            gradient_accumulation_steps=1,
            gradient_checkpointing=lora.gradient_checkpointing,
        )
    finally:
        registry.release_all()
    merged = dequant_merge(spec, report.adapter_dir, maximum_memory_usage=0.5)
    return {
        "loaded": loaded,
        "names": names,
        "linear_4bit": linear_4bit,
        "losses": losses,
        "lora": lora,
        "report": report,
        "merged": Path(merged.out_dir),
    }


def _packed_and_alone(model, tokenizer, examples) -> tuple[float, float, float]:
    """Mean token loss of a few examples packed into shared rows, the same examples one per row, and the packed
    rows with one continuous position range (attending across examples: the control)."""

    def loss_sum_and_count(batch) -> tuple[float, int]:
        batch = {k: v for k, v in batch.items() if not k.startswith("_")}
        with torch.no_grad():
            loss = model(**batch).loss.double()
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        return float(loss) * n, n

    chosen = examples.train[:8]
    rows = pack(chosen, 128)
    assert any(len(r.seq_lens) > 2 for r in rows)  # really packed
    assert choose_batching(model, "packed").mode == "packed"  # the loaded text model isolates packed examples
    batch = RowCollator("packed", tokenizer.pad_token_id)(rows)
    total, count = loss_sum_and_count(batch)
    alone = [loss_sum_and_count(RowCollator("padded", 0)(one_per_row([e]))) for e in chosen]
    assert count == sum(n for _, n in alone)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    leaked, _ = loss_sum_and_count(batch)
    return total / count, sum(s for s, _ in alone) / count, leaked / count


def test_validate_plan_and_init_accept_the_multimodal_checkpoint(base, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    )
    fields = {"name": "g", "output_dir": str(tmp_path / "runs"), "model": {"name_or_path": str(base)}}
    spec.write_text(yaml.safe_dump({**fields, "data": {"path": str(data)}}))
    assert main(["validate", str(spec)]) == 0
    assert main(["plan", str(spec), "--gpu-memory", "16GiB", "--host-memory", "16GiB"]) == 0
    capsys.readouterr()
    assert main(["init", "--model", str(base), "--data", str(data), "--gpu-memory", "16GiB"]) == 0
    assert "family gemma3, its language model gemma3_text trained" in capsys.readouterr().out
    # what the language model's own config cannot do is still refused, in one line naming it
    cfg = json.loads((base / "config.json").read_text())
    (tmp_path / "bad").mkdir()
    for f in base.iterdir():
        (tmp_path / "bad" / f.name).symlink_to(f)
    (tmp_path / "bad" / "config.json").unlink()
    bad = {**cfg, "text_config": {**cfg["text_config"], "query_pre_attn_scalar": 256}}
    (tmp_path / "bad" / "config.json").write_text(json.dumps(bad))
    spec.write_text(
        yaml.safe_dump({**fields, "model": {"name_or_path": str(tmp_path / "bad")}, "data": {"path": str(data)}})
    )
    capsys.readouterr()
    assert main(["validate", str(spec)]) == EXIT_INVALID_SPEC
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gemma3_text config: query_pre_attn_scalar 256" in err[0], err


def test_other_multimodal_types_and_pre_quantized_ones_are_refused_in_one_line(base):
    config = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": {}}
    problem = check_architecture(config)
    assert problem is not None and "\n" not in problem and "'llava'" in problem
    assert f"the language model of {', '.join(LAYOUTS)} multimodal checkpoints" in problem
    # a bitsandbytes upload: the language model would be built without its quantization_config
    gemma3 = json.loads((base / "config.json").read_text())
    assert check_architecture(gemma3) is None
    quantized = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    problem = check_architecture({**gemma3, "quantization_config": quantized})
    assert problem is not None and "\n" not in problem and "a pre-quantized gemma3 multimodal checkpoint" in problem


def test_nf4_load_holds_the_language_model_alone(base, run):
    loaded = run["loaded"]
    assert loaded.model_type == "gemma3_text"
    assert not [n for n in run["names"] if "vision" in n or "multi_modal" in n]  # the tower is never loaded
    # every decoder projection in NF4 (7 per layer, 6 layers), under the text model's own names
    assert len(run["linear_4bit"]) == loaded.linear_4bit == 7 * 6
    keys = checkpoint_names(checkpoint_tensors(base))
    text_weights = {n for n in run["names"] if not n.startswith("lm_head")}
    assert {f"{n}.weight" for n in run["linear_4bit"]} <= set(keys) and text_weights <= set(keys)


def test_lora_targets_the_language_model_and_eval_then_train_lowers_the_loss(run):
    lora, report = run["lora"], run["report"]
    assert lora.target_modules == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # r=16 on 7 projections of 6 layers: (in + out) * 16 each
    per_layer = (256 + 256) + (256 + 128) * 2 + (256 + 256) + (256 + 512) * 2 + (512 + 256)
    assert lora.trainable_parameters == 16 * per_layer * 6
    assert report.eval_loss_after < report.eval_loss_before


def test_packed_loss_equals_the_per_example_loss(run):
    packed, alone, leaked = run["losses"]
    # NF4 weights, fp32 compute: 1e-5 is ~100x the summation-order noise of the text families' same check
    assert packed == pytest.approx(alone, abs=1e-5)
    assert abs(leaked - alone) > 1e-4  # the control: examples that see each other's tokens differ, 10x the tolerance


def test_merge_keeps_the_layout_and_matches_peft(base, run):
    _assert_merged_like_peft(base, run["merged"], Path(run["report"].adapter_dir), n_targets=7 * 6)


def _assert_merged_like_peft(
    base: Path, merged: Path, adapter: Path, n_targets: int, n_linears: int | None = None
) -> None:
    """The merged checkpoint has the base's layout, its vision weights byte for byte, and peft's merged text weights
    (`n_targets` LoRA targets among `n_linears` 4-bit linears, the same unless some stay frozen)."""
    before, after = checkpoint_tensors(base), checkpoint_tensors(merged)
    assert set(after) == set(before)  # the checkpoint's own key names
    config, merged_config = (json.loads((d / "config.json").read_text()) for d in (base, merged))
    assert merged_config["architectures"] == config["architectures"] and config["architectures"][0].endswith(
        "ForConditionalGeneration"
    )
    assert merged_config["text_config"] == config["text_config"]
    assert merged_config["vision_config"] == config["vision_config"]
    names = checkpoint_names(before)
    vision = set(before) - set(names.values())
    # Qwen3.5: its tower and merger under model.visual, its multi-token prediction under mtp; Gemma 4: embed_vision
    towers = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.visual.",
        "mtp.",
        "model.vision_tower.",
        "model.embed_vision.",
    )
    assert vision and all(k.startswith(towers) for k in vision)
    for key in vision:  # copied through byte for byte
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    # peft's own merge of the same adapter into the fp32 language model
    text = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **text_model_load_kwargs(base))
    reference = PeftModel.from_pretrained(text, adapter).merge_and_unload().state_dict()
    changed = 0
    for name, key in names.items():
        if name not in reference:
            continue  # lm_head: tied to the embeddings, which the checkpoint holds once
        # fp32 W + scale * (B @ A) both ways, summed in another order: 1e-6 is ~10x the rounding seen
        torch.testing.assert_close(after[key], reference[name], rtol=0, atol=1e-6, msg=key)
        changed += not torch.equal(after[key], before[key])
    assert changed == n_targets  # every LoRA target moved; nothing else did
    # the dequantized source rebuilds exactly the NF4 weights training saw: the language model's, by checkpoint key
    quantized = {names[n] for n in quantized_tensor_names(base, TRAINING_NF4)}
    assert len(quantized) == (n_targets if n_linears is None else n_linears) and not quantized & vision


def test_the_language_model_alone_computes_what_the_whole_checkpoint_does_on_text(run):
    merged = run["merged"]
    whole = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    alone = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, **text_model_load_kwargs(merged))
    assert type(whole).__name__ == "Gemma3ForConditionalGeneration" and type(alone).__name__ == "Gemma3ForCausalLM"
    ids = torch.arange(1, 60).view(1, -1)  # past the 16-token sliding window
    with torch.no_grad():
        # the same modules in the same order: equal to the bit (why load_4bit leaves the vision tower unloaded)
        torch.testing.assert_close(alone(ids).logits, whole(ids).logits, rtol=0, atol=0)


# transformers 5's in-memory names, which some checkpoints are saved with (the Hub's and transformers 5.23's saves
# keep the older `language_model.model.*`, `vision_tower.*` layout of the fixture)
_IN_MEMORY = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def _in_memory_key(key: str) -> str:
    return next((new + key.removeprefix(old) for old, new in _IN_MEMORY if key.startswith(old)), key)


def test_a_checkpoint_in_transformers_in_memory_layout_loads_and_merges_under_its_own_keys(base, run, tmp_path):
    other = tmp_path / "base"
    other.mkdir()
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    before = {_in_memory_key(k): t for k, t in checkpoint_tensors(base).items()}
    assert any(k.startswith("model.language_model.") for k in before)
    save_file(before, other / "model.safetensors", metadata={"format": "pt"})
    ids = torch.arange(1, 40).view(1, -1)
    with torch.no_grad():
        logits = [
            AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **text_model_load_kwargs(d))(ids).logits
            for d in (base, other)
        ]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)  # the same language model, from either layout
    spec = _spec(other, tmp_path)
    merged = Path(dequant_merge(spec, run["report"].adapter_dir, maximum_memory_usage=0.5).out_dir)
    after = checkpoint_tensors(merged)
    assert set(after) == set(before)
    expected = {_in_memory_key(k): t for k, t in checkpoint_tensors(run["merged"]).items()}
    for key, t in after.items():  # the same merge as of the fixture's layout, tensor for tensor
        assert torch.equal(t, expected[key]), key


@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
def test_gguf_of_the_language_model_runs_in_llama_cpp(run, tmp_path, out_type):
    pytest.importorskip("llama_cpp")
    merged = run["merged"]
    [path] = convert_hf_to_gguf(merged, tmp_path / f"mm-{out_type}.gguf", out_type)
    # against the merged multimodal checkpoint as transformers loads it (Gemma3ForConditionalGeneration, text only)
    report = verify_gguf(path, merged, PROMPTS)
    assert report["token_ids_equal"] and report["positions"] > 100, report
    # Measured: f16 0.0042 off HF with every next token HF's; q8_0 0.095 off, every next token HF's. A conversion
    # mistake (a vision key taken for a text one, a norm without Gemma's +1) moves logits by whole units.
    low, high = (1e-7, 0.05) if out_type == "f16" else (1e-3, 0.5)
    assert report["argmax_agreement"] >= 0.97 and low < report["max_abs_logit_diff"] < high, report


def _merge_a_random_adapter(
    base: Path, tmp_path: Path, text_model_type: str, linears: int, targets: int | None = None
) -> Path:
    """load_4bit, attach_lora and dequant_merge of `base`, a random non-zero LoRA B standing in for training; checks
    the language model loads alone in NF4 (`linears` 4-bit linears, no vision parameter) and the merge is peft's
    (`targets` LoRA targets: `linears` unless some 4-bit linears stay frozen)."""
    spec = _spec(base, tmp_path)
    adapter = tmp_path / "adapter"

    def language_model_alone(loaded) -> None:
        assert loaded.model_type == text_model_type and loaded.linear_4bit == linears
        names = [n for n, _ in registry.get(loaded.handle).named_parameters()]
        assert not [n for n in names if "vision" in n or "projector" in n or "visual" in n]

    merged = merge_random_adapter(spec, adapter, language_model_alone)
    _assert_merged_like_peft(
        base, merged, adapter, n_targets=linears if targets is None else targets, n_linears=linears
    )
    return merged


def _assert_alone_is_whole_and_f16_verifies(merged: Path, whole_class, tmp_path: Path) -> None:
    """The language model alone computes the whole merged checkpoint's logits to the bit, and its f16 GGUF runs
    in llama.cpp, held to the text families' f16 bar (tests/test_gguf_quant_verify.py)."""
    whole = whole_class.from_pretrained(merged, dtype=torch.float32)
    alone = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, **text_model_load_kwargs(merged))
    ids = torch.arange(1, 40).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(alone(ids).logits, whole(input_ids=ids).logits, rtol=0, atol=0)
    [path] = convert_hf_to_gguf(merged, tmp_path / "merged-f16.gguf", "f16")
    report = verify_gguf(path, merged, PROMPTS)
    assert report["token_ids_equal"] and report["argmax_agreement"] >= 0.97, report
    assert 1e-7 < report["max_abs_logit_diff"] < 0.5, report


def test_mistral3_language_model_loads_merges_and_converts(tmp_path):
    """Mistral-Small-3.1/3.2's layout (Pixtral tower, untied head): the same stages without the training run.
    f16 measured 0.10 off HF (the text mistral's own f16 file: up to 0.19), HF's next token at 124 of 125 positions."""
    pytest.importorskip("llama_cpp")
    base = save_tiny_multimodal(tmp_path / "base", ensure_pretrained("mistral", "llama2"), "mistral3")
    assert check_architecture(json.loads((base / "config.json").read_text())) is None
    merged = _merge_a_random_adapter(base, tmp_path, "mistral", linears=7 * 4)
    assert "language_model.lm_head.weight" in checkpoint_tensors(merged)  # untied: the checkpoint's own head
    # no Auto class loads Mistral3ForConditionalGeneration as a causal LM: its own class, against the text model
    _assert_alone_is_whole_and_f16_verifies(merged, Mistral3ForConditionalGeneration, tmp_path)


def test_gemma4_language_model_loads_merges_and_converts(tmp_path):
    """Gemma 4's layout (its vision encoder and `embed_vision`; per-layer inputs and KV sharing in the language
    model): the same stages without the training run. Six layers of nine 4-bit linears (the per-layer input gate
    and projection stay frozen) and the model's per-layer input projection; LoRA on the seven projections."""
    pytest.importorskip("llama_cpp")
    base = save_tiny_multimodal(tmp_path / "base", ensure_pretrained("gemma4_text", "gemma"), "gemma4")
    config = json.loads((base / "config.json").read_text())
    assert check_architecture(config) is None
    moe = {**config, "text_config": {**config["text_config"], "enable_moe_block": True}}  # Gemma 4 26B-A4B
    assert "mixture-of-experts block (Gemma 4 26B-A4B) is not supported" in check_architecture(moe)
    merged = _merge_a_random_adapter(base, tmp_path, "gemma4_text", linears=9 * 6 + 1, targets=7 * 6)
    assert any(key.startswith("model.embed_vision.") for key in checkpoint_tensors(merged))
    _assert_alone_is_whole_and_f16_verifies(merged, Gemma4ForConditionalGeneration, tmp_path)


def test_plan_counts_the_vision_weights_the_merge_copies_on_disk(base):
    """The merged checkpoint keeps the vision tower and projector as stored: `plan`'s disk for the merge counts
    their bytes, as the checkpoint's own files hold them (not only the language model's)."""
    config = json.loads((base / "config.json").read_text())
    stored = sum(t.numel() * t.element_size() for key, t in checkpoint_tensors(base).items() if text_key(key) is None)
    spec = PipelineSpec.model_validate({"name": "g", "model": {"name_or_path": str(base)}, "data": {"path": "x"}})
    assert stored > 0 and copied_bytes(config, stored_tensor_bytes(spec)) == stored
    rows, _ = plan(spec, config, Budget(None, None, None))
    (merge,) = [r for r in rows if r.stage == "dequant_merge"]
    assert merge.estimate.breakdown["disk: weights copied as stored (vision tower, projector, mtp)"] == stored
    assert merge.estimate.disk_bytes > stored


def test_qwen35_language_model_loads_merges_and_converts(tmp_path):
    """The released Qwen3.5 checkpoints' layout (`model.language_model.*`, `model.visual.*`, `mtp.*`): the hybrid
    DeltaNet language model alone in NF4 (4 layers: 7 projections in the attention one, 8 in each DeltaNet one), the
    merge under the checkpoint's own names with the tower and the multi-token prediction copied, its f16 GGUF."""
    pytest.importorskip("llama_cpp")
    base = save_tiny_multimodal(tmp_path / "base", ensure_pretrained("qwen3_5_text"), "qwen3_5")
    assert check_architecture(json.loads((base / "config.json").read_text())) is None
    # the released checkpoints also hold multi-token-prediction weights, which transformers' class does not load
    [shard] = base.glob("*.safetensors")
    tensors = checkpoint_tensors(base)
    save_file({**tensors, "mtp.fc.weight": torch.randn(256, 512)}, str(shard), metadata={"format": "pt"})
    assert any(key.startswith("model.visual.") for key in tensors)
    merged = _merge_a_random_adapter(base, tmp_path, "qwen3_5_text", linears=31)
    _assert_alone_is_whole_and_f16_verifies(merged, Qwen3_5ForConditionalGeneration, tmp_path)
