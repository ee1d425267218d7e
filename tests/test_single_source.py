"""Each memory-related fact has one definition that every user reads: GGUF types, the downshift rule,
the NF4 settings and maximum_memory_usage's range."""

from __future__ import annotations

import pytest

from slimtune.core.gguf_types import GGUF_ALIASES, GGUF_LLAMA_CPP, GGUF_NATIVE, GGUF_TYPES

LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def test_the_spec_the_exporters_and_the_estimate_read_the_gguf_table():
    from slimtune.export import gguf_quantize
    from slimtune.memory.estimate import estimate_export
    from slimtune.spec import schema as spec

    assert spec.GGUF_NATIVE is GGUF_NATIVE and spec.GGUF_LLAMA_CPP is GGUF_LLAMA_CPP
    assert set(GGUF_NATIVE) | set(GGUF_LLAMA_CPP) == set(GGUF_TYPES)
    assert gguf_quantize.CONVERTER_TYPES == GGUF_NATIVE
    assert set(gguf_quantize.GGUF_METHODS) == set(GGUF_TYPES) | set(GGUF_ALIASES)
    # Every type the spec accepts has an export estimate (six of them raised before the table existed).
    for name in GGUF_TYPES:
        est = estimate_export(LLAMA_8B, out_types=[name])
        assert est.disk_bytes > 0
        assert ("disk: f16 intermediate for k-quants" in est.breakdown) == (name in GGUF_LLAMA_CPP)


def test_spec_rejects_a_type_outside_the_table():
    from slimtune.spec.schema import ExportSpec

    with pytest.raises(ValueError, match="unknown GGUF type"):
        ExportSpec(gguf=["q9_x"])
    assert ExportSpec(gguf=["f16", "quantized"][:1]).gguf == ["f16"]


@pytest.mark.parametrize("micro_batch,grad_accum", [(3, 1), (6, 2), (8, 1), (5, 3), (1, 4)])
def test_crash_hook_and_retry_ladder_take_the_same_step(micro_batch, grad_accum):
    from slimtune.flows.resubmit import crash_downshift
    from slimtune.memory.downshift import downshift_train

    ladder = downshift_train(micro_batch, grad_accum, True, attempt=2)
    train = {"micro_batch_size": micro_batch, "gradient_accumulation_steps": grad_accum}
    crash = crash_downshift({"spec": {"train": train, "lora": {"gradient_checkpointing": True}}})["spec"]
    assert crash["train"]["micro_batch_size"] == ladder.micro_batch
    assert crash["train"]["gradient_accumulation_steps"] == ladder.grad_accum
    assert crash["lora"]["gradient_checkpointing"] == ladder.checkpointing
    # The effective batch is in the resume fingerprint: it must not change.
    assert ladder.micro_batch * ladder.grad_accum == micro_batch * grad_accum


def test_maximum_memory_usage_has_one_range():
    from slimtune.memory.downshift import downshift_merge
    from slimtune.merge.budgets import resolve_budgets
    from slimtune.spec.schema import MERGE_MEMORY_USAGE_MAX, MergeSpec

    assert MergeSpec(maximum_memory_usage=MERGE_MEMORY_USAGE_MAX).maximum_memory_usage == MERGE_MEMORY_USAGE_MAX
    with pytest.raises(ValueError):
        MergeSpec(maximum_memory_usage=MERGE_MEMORY_USAGE_MAX + 0.01)
    assert downshift_merge(MERGE_MEMORY_USAGE_MAX, 1).maximum_memory_usage == MERGE_MEMORY_USAGE_MAX
    with pytest.raises(ValueError, match="maximum_memory_usage"):
        downshift_merge(MERGE_MEMORY_USAGE_MAX + 0.01, 1)
    with pytest.raises(ValueError, match="maximum_memory_usage"):
        resolve_budgets(MERGE_MEMORY_USAGE_MAX + 0.01, "cpu", None, None)


def test_load_and_merge_use_the_same_nf4_settings():
    import inspect

    import torch

    from slimtune.merge.nf4 import TRAINING_NF4, QuantSpec
    from slimtune.tasks import dequant_merge, load_4bit

    qc = TRAINING_NF4.bnb_config(torch.bfloat16)
    assert (qc.bnb_4bit_quant_type, qc.bnb_4bit_use_double_quant, qc.bnb_4bit_quant_storage) == (
        "nf4",
        True,
        torch.uint8,
    )
    assert TRAINING_NF4 == QuantSpec()
    # Neither task spells the settings out itself.
    for module in (load_4bit, dequant_merge):
        source = inspect.getsource(module)
        assert "TRAINING_NF4" in source and "bnb_4bit_quant_type" not in source
