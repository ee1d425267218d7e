"""Bad input: malformed specs and data files fail before any model is loaded, naming the field or file:line and the fix.

Specs go through the CLI (`slimtune run SPEC`), which must stop with exit code 2 before it even imports the
flow; data files go through the finetune flow itself, whose model stages are stubbed to prove that none
of them started.
"""

from __future__ import annotations

import sys

import pytest
import yaml
from faultlib import BASE_SPEC, WIRING_ONLY, run_finetune, spec_dict, stub_model_stages

from slimtune.cli.main import EXIT_INVALID_SPEC, main

# (case id, changes as {section: {field: value}} (None deletes), field the message must name, fix it must give)
_SPEC_CASES = [
    ("lora.r wrong type", {"lora": {"r": "sixteen"}}, "lora.r", "valid integer"),
    ("lora.r zero", {"lora": {"r": 0}}, "lora.r", "greater than 0"),
    ("lora.r too large", {"lora": {"r": 5000}}, "lora.r", "less than or equal to 1024"),
    ("lora.alpha negative", {"lora": {"alpha": -1}}, "lora.alpha", "greater than 0"),
    ("lora.dropout >= 1", {"lora": {"dropout": 1.5}}, "lora.dropout", "less than 1"),
    ("lora.target_modules empty", {"lora": {"target_modules": []}}, "lora.target_modules", "non-empty list"),
    (
        "lora.gradient_checkpointing bad",
        {"lora": {"gradient_checkpointing": "sometimes"}},
        "lora.gradient_checkpointing",
        "unsloth",
    ),
    ("lora.bias bad", {"lora": {"bias": "some"}}, "lora.bias", "lora_only"),
    ("lora unknown key", {"lora": {"rank": 8}}, "lora.rank", "unknown key; remove it"),
    ("top-level unknown key", {"trainer": {"lr": 1}}, "trainer", "unknown key; remove it"),
    ("train.micro_batch_size zero", {"train": {"micro_batch_size": 0}}, "train.micro_batch_size", "greater than 0"),
    ("train.learning_rate > 1", {"train": {"learning_rate": 2.0}}, "train.learning_rate", "less than or equal to 1"),
    ("train.learning_rate string", {"train": {"learning_rate": "fast"}}, "train.learning_rate", "valid number"),
    ("train.max_steps negative", {"train": {"max_steps": -1}}, "train.max_steps", "greater than 0"),
    ("train.optimizer unknown", {"train": {"optimizer": "sgd"}}, "train.optimizer", "adamw_torch"),
    ("train.precision unknown", {"train": {"precision": "fp8"}}, "train.precision", "bf16"),
    ("train.save_steps zero", {"train": {"save_steps": 0}}, "train.save_steps", "greater than 0"),
    ("train.epochs zero", {"train": {"epochs": 0}}, "train.epochs", "greater than 0"),
    ("train.seed float", {"train": {"seed": 1.5}}, "train.seed", "integer"),
    (
        "data.path missing file",
        {"data": {"path": "/nonexistent/chat.jsonl"}},
        "data.path",
        "give an existing .jsonl/.json/.parquet file",
    ),
    ("data.path a directory", {"data": {"path": "/tmp"}}, "data.path", "give a data file"),
    (
        "data.max_seq_length too small",
        {"data": {"max_seq_length": 8}},
        "data.max_seq_length",
        "greater than or equal to 16",
    ),
    ("data.eval_fraction too large", {"data": {"eval_fraction": 0.7}}, "data.eval_fraction", "less than 0.5"),
    ("data.packing unknown", {"data": {"packing": "zip"}}, "data.packing", "padding_free"),
    (
        "merge.maximum_memory_usage > 0.95",
        {"merge": {"maximum_memory_usage": 1.2}},
        "merge.maximum_memory_usage",
        "less than or equal to 0.95",
    ),
    (
        "gguf without merge",
        {"merge": {"enabled": False}, "export": {"gguf": ["f16"]}},
        "merge.enabled",
        "set export.gguf: []",
    ),
    (
        "fp16 with bf16 compute",
        {"train": {"precision": "fp16"}, "model": {"compute_dtype": "bfloat16"}},
        "train.precision",
        "use bf16 for both or fp16 for both",
    ),
    ("unknown GGUF type", {"export": {"gguf": ["q9"]}}, "export.gguf", "q4_k_m"),
    ("push.repo_id without org", {"export": {"push": {"repo_id": "noslash"}}}, "export.push.repo_id", "org/name"),
    (
        "push without repo_id",
        {"export": {"push": {"private": True}}},
        "export.push.repo_id",
        "required field is missing",
    ),
    (
        "unknown builtin model",
        {"model": {"name_or_path": "builtin:tiny-gpt2"}},
        "model.name_or_path",
        "builtin:tiny-llama",
    ),
    (
        "missing local model dir",
        {"model": {"name_or_path": "./no-such-model"}},
        "model.name_or_path",
        "give an existing directory",
    ),
    ("model.device bad", {"model": {"device": "gpu0"}}, "model.device", "cuda:N"),
    ("model.compute_dtype bad", {"model": {"compute_dtype": "int8"}}, "model.compute_dtype", "bfloat16"),
    ("run name with spaces", {"name": "my run!"}, "name", "pattern"),
    ("guard.max_retries > 10", {"guard": {"max_retries": 11}}, "guard.max_retries", "less than or equal to 10"),
]


def _write(tmp_path, changes: dict) -> str:
    data = spec_dict(tmp_path / "runs")
    for section, values in changes.items():
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            data[section].update(values)
        else:
            data[section] = values
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    loaded = "slimtune.flows.finetune" in sys.modules
    code = main(argv)
    err = capsys.readouterr().err
    if not loaded:  # the flow (and with it every model stage) must not even be imported for a bad spec
        assert "slimtune.flows.finetune" not in sys.modules
    return code, err


@pytest.mark.parametrize("case,changes,field,fix", _SPEC_CASES, ids=[c[0] for c in _SPEC_CASES])
@pytest.mark.fault(
    "Bad input: malformed spec",
    stage="spec",
    expect="exit code 2 before any model is loaded; one line naming the field and the fix",
)
def test_bad_spec(tmp_path, capsys, observe, case, changes, field, fix):
    code, err = _cli(["run", _write(tmp_path, changes)], capsys)
    # a combination of fields is reported at the top level, naming both fields in the text
    line = next((ln for ln in err.splitlines() if ln.strip().startswith("- ") and field in ln), None)
    observe(line.strip() if line else err.strip().splitlines()[0])
    assert code == EXIT_INVALID_SPEC, err
    assert line is not None, f"no problem line names {field}:\n{err}"
    assert fix in line, f"the line for {field} does not say how to fix it ({fix!r}):\n{line}"


@pytest.mark.fault(
    "Bad input: malformed spec",
    stage="spec",
    expect="k-quants without the llama.cpp extra: fails at validation with the pip command",
)
def test_kquant_without_llama_cpp(tmp_path, capsys, monkeypatch, observe):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec() now reports it as not installed
    code, err = _cli(["validate", _write(tmp_path, {"export": {"gguf": ["q4_k_m"]}})], capsys)
    line = next((ln for ln in err.splitlines() if "export.gguf" in ln), "")
    observe(line.strip())
    assert code == EXIT_INVALID_SPEC and "pip install 'slimtune[llama-cpp]'" in line, err


@pytest.mark.parametrize(
    "text,where",
    [("- just\n- a list\n", "mapping"), ("lora: {r: 8\n", "not valid YAML")],
    ids=["not a mapping", "YAML syntax error"],
)
@pytest.mark.fault("Bad input: malformed spec", stage="spec", expect="exit code 2 with what is wrong")
def test_unreadable_spec(tmp_path, capsys, observe, text, where):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    code, err = _cli(["run", str(path)], capsys)
    observe(err.strip().splitlines()[-2] if len(err.strip().splitlines()) > 1 else err.strip())
    assert code == EXIT_INVALID_SPEC and where in err, err


_GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
_DATA_CASES = [
    ("bad JSON line", (_GOOD * 2 + '{"messages": [oops]}\n').encode(), ":3:", "not valid JSON"),
    ("missing field", (_GOOD + '{"conversation": []}\n').encode(), ":2:", "data.messages_field"),
    ("message without content", (_GOOD + '{"messages": [{"role": "user"}]}\n').encode(), ":2:", "messages[0].content"),
    ("empty file", b"", ":1:", "empty"),
    (
        "not UTF-8",
        (_GOOD + '{"messages": [{"role": "user", "content": "caf').encode() + b"\xe9\xff" + b'"}]}\n',
        ":2:",
        "not UTF-8",
    ),
]


@pytest.mark.parametrize("case,content,where,fix", _DATA_CASES, ids=[c[0] for c in _DATA_CASES])
@pytest.mark.fault(
    "Bad input: malformed dataset file",
    stage="data",
    expect="the flow fails before load_4bit starts, naming file:line and the fix",
)
def test_bad_data(tmp_path, prefect_harness, observe, case, content, where, fix):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    spans: list = []
    with pytest.MonkeyPatch.context() as mp:
        stub_model_stages(mp, spans)
        with pytest.raises(Exception) as err:
            run_finetune(spec_dict(tmp_path, **WIRING_ONLY, data={**BASE_SPEC["data"], "path": str(data)}))
    message = str(err.value)
    observe(f"{type(err.value).__name__}: {message.replace(str(tmp_path), '…')[:160]}")
    assert spans == [], f"model stages ran before the bad data was found: {spans}"
    assert f"{data}{where}" in message, message
    assert fix in message, message
