"""Messages for data and settings that cannot work as written: say how many, what limit, and the fix."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from slimtune.core import registry
from slimtune.data import DataError, load_examples
from slimtune.models.tiny import DATA_FILE, save_tiny
from slimtune.spec.schema import DataSpec, ModelSpec, PipelineSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.load_4bit import load_4bit

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model"), "llama", **_SMALL)


@pytest.mark.fault(
    "Bad input: every example too long",
    stage="data",
    expect="the error says how many were dropped or truncated, the limit, the longest example and the fix",
)
@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_all_examples_too_long_says_how_many_and_the_limit(overlong, model_dir, observe):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n = len(DATA_FILE.read_text(encoding="utf-8").splitlines())
    data = DataSpec(path=str(DATA_FILE), max_seq_length=16, overlong=overlong)
    with pytest.raises(DataError) as e:
        load_examples(data, tokenizer)
    text = str(e.value)
    counted = f"{n} dropped as longer" if overlong == "drop" else f"{n} truncated to it"
    assert counted in text and "data.max_seq_length 16" in text and "raise data.max_seq_length to" in text, text
    observe(text.split(": ", 1)[1][:220])


@pytest.mark.fault(
    "Bad input: unknown chat roles",
    stage="data",
    expect="human/gpt roles are named with file:line and the fix (user/assistant)",
)
def test_unknown_roles_are_named(model_dir, tmp_path, observe):
    path = tmp_path / "sharegpt.jsonl"
    record = {"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"sharegpt.jsonl:1.*messages\[0\]\.role.*'human'.*user/assistant") as e:
        load_examples(DataSpec(path=str(path)), AutoTokenizer.from_pretrained(model_dir))
    observe(str(e.value).replace(str(tmp_path), "…")[:220])


@pytest.mark.fault(
    "Settings: lora.r above the hidden size", stage="attach_lora", expect="a warning naming both numbers"
)
def test_rank_above_hidden_size_warns(model_dir, caplog, observe):
    spec = PipelineSpec()
    spec.model = ModelSpec(name_or_path=str(model_dir), device="cpu")
    spec.lora.r, spec.lora.gradient_checkpointing = 128, False
    try:
        with caplog.at_level(logging.WARNING, logger="slimtune"):
            attach_lora(spec, load_4bit(spec).handle)
    finally:
        registry.release_all()
    warned = [r.getMessage() for r in caplog.records if "lora.r 128 exceeds" in r.getMessage()]
    assert warned and "hidden size 64" in warned[0]
    observe(warned[0])
