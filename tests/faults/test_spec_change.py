"""A changed spec re-run under the same name: never resumed from the other spec's checkpoints.

Each spec field either reaches the resume fingerprint (changing it changes `model_settings` or the spec
sections hashed by the trainer) or is listed below with the reason it cannot change the trained weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimtune.core import registry
from slimtune.data import load_examples
from slimtune.models.tiny import DATA_FILE, save_tiny
from slimtune.spec.schema import DataSpec, LoraSpec, ModelSpec, PipelineSpec, TrainSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.load_4bit import load_4bit
from slimtune.train.resume import _OPERATIONAL, model_settings
from slimtune.train.trainer import train_adapter

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)

# Spec fields outside the fingerprint, and why they cannot change the trained weights.
_IRRELEVANT = {
    "lora.gradient_checkpointing": "recomputes the same activations; gradients are identical",
    "model.device": "where the same computation runs; resuming on another device is intended",
    "model.attn_implementation": "the same attention, another kernel",
    "model.trust_remote_code": "a permission to load, not a setting of the model",
    "model.allow_pickle": "a permission to load, not a setting of the model",
    "model.revision": "resolved into the model folder, which is in the fingerprint",
}
# A value other than the default for every LoRA and model field that must reach the fingerprint.
_LORA_CHANGES = {
    "r": 4,
    "alpha": 32,
    "dropout": 0.1,
    "target_modules": ["q_proj", "v_proj"],
    "use_rslora": True,
    "bias": "all",
    "train_embeddings": True,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("base"), "llama", **_SMALL)


def _spec(base: Path, **lora) -> PipelineSpec:
    spec = PipelineSpec()
    spec.model = ModelSpec(name_or_path=str(base), device="cpu")
    spec.lora = LoraSpec(**{"gradient_checkpointing": False, "r": 8, "alpha": 16, **lora})
    return spec


def _settings(spec: PipelineSpec) -> dict:
    try:
        return model_settings(registry.get(attach_lora(spec, load_4bit(spec).handle).handle))
    finally:
        registry.release_all()


@pytest.mark.fault(
    "Changed spec, same run name",
    stage="packed_sft",
    expect="every spec field is in the resume fingerprint or proven irrelevant to the trained weights",
)
def test_every_spec_field_is_fingerprinted_or_irrelevant(base, tmp_path, observe):
    reference = _settings(_spec(base))
    changed = {f"lora.{k}": _settings(_spec(base, **{k: v})) != reference for k, v in _LORA_CHANGES.items()}
    other = save_tiny(tmp_path / "other", "llama", seed=1, **_SMALL)
    changed["model.name_or_path"] = _settings(_spec(other)) != reference
    bf16 = _spec(base)
    bf16.model.compute_dtype = "bfloat16"
    changed["model.compute_dtype"] = _settings(bf16) != reference
    observe(f"{sum(changed.values())}/{len(changed)} model and LoRA fields change the fingerprint")
    assert all(changed.values()), [k for k, v in changed.items() if not v]
    # every field of the sections that shape training is accounted for
    for section, model in (("lora", LoraSpec), ("model", ModelSpec)):
        for name in model.model_fields:
            key = f"{section}.{name}"
            assert key in changed or key in _IRRELEVANT, f"{key}: neither fingerprinted nor proven irrelevant"
    # train: all but the operational fields are hashed (resume.training_settings); data: all of it
    assert _OPERATIONAL < set(TrainSpec.model_fields)


def _train(base: Path, run_dir: Path, **lora):
    spec = _spec(base, **lora)
    data = DataSpec(path=str(DATA_FILE), max_seq_length=96, eval_fraction=0.0)
    train = TrainSpec(learning_rate=5e-3, max_steps=3, save_steps=2, seed=0)
    model = registry.get(attach_lora(spec, load_4bit(spec).handle).handle)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    try:
        return train_adapter(
            model,
            tokenizer,
            load_examples(data, tokenizer),
            train,
            data,
            run_dir,
            micro_batch_size=2,
            gradient_accumulation_steps=1,
        )
    finally:
        registry.release_all()


@pytest.mark.fault(
    "Changed spec, same run name",
    stage="packed_sft",
    expect="a finished run re-run with another lora.alpha or lora.r trains from scratch and says why",
)
def test_changed_lora_does_not_resume_the_finished_checkpoint(base, tmp_path, observe):
    run_dir = tmp_path / "run"
    first = _train(base, run_dir)
    assert first.steps == 3 and first.not_resumed is None
    again = _train(base, run_dir)  # unchanged: resumes the finished checkpoint and trains nothing
    assert again.resumed_from is not None and again.steps == 3  # Trainer alone trained a 4th step here
    alpha = _train(base, run_dir, alpha=64)
    assert alpha.resumed_from is None and alpha.steps == 3
    assert "lora.lora_alpha 16" in alpha.not_resumed and "-> 64" in alpha.not_resumed
    assert (run_dir / "checkpoints.previous").is_dir()
    rank = _train(base, run_dir, alpha=64, r=4)  # peft failed loading r=8 weights into r=4 layers
    assert rank.resumed_from is None and "lora.r 8 -> 4" in rank.not_resumed
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 64)
    observe(f"alpha 16 -> 64: {alpha.not_resumed.split(' (', 1)[1][:160]}")
