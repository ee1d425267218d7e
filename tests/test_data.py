"""Data loading: formats, completion-only labels, truncation, the split, and malformed-record errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slimtune.data import IGNORE_INDEX, DataError, load_examples
from slimtune.models.tiny import DATA_FILE, ensure_builtin
from slimtune.spec.schema import DataSpec

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
    ]
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_builtin("builtin:tiny-llama"))


def _jsonl(tmp_path: Path, records: list, name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    lines = [(r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _load(tokenizer, path: Path, **kw):
    return load_examples(DataSpec(path=str(path), eval_fraction=kw.pop("eval_fraction", 0), **kw), tokenizer)


def _targets(tokenizer, example) -> list[str]:
    return [tokenizer.decode([t]) for t, lab in zip(example.input_ids, example.labels) if lab != IGNORE_INDEX]


def test_chat_completion_only_mask_is_exact(tokenizer, tmp_path):
    ex = _load(tokenizer, _jsonl(tmp_path, [CHAT])).train[0]
    text = tokenizer.decode(ex.input_ids)
    # Hand-checked against the ChatML template: only the assistant reply and its <|im_end|> are targets.
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    reply = tokenizer("Hello.", add_special_tokens=False)["input_ids"]
    reply += [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    start = len(ex.input_ids) - 1 - len(reply)  # the reply ends right before the final "\n"
    assert ex.input_ids[start : start + len(reply)] == reply
    expected = [IGNORE_INDEX] * len(ex.input_ids)
    expected[start : start + len(reply)] = reply
    assert ex.labels == expected


def test_chat_two_assistant_turns_keep_user_turn_masked(tokenizer, tmp_path):
    msgs = CHAT["messages"] + [{"role": "user", "content": "And?"}, {"role": "assistant", "content": "Bye."}]
    ex = _load(tokenizer, _jsonl(tmp_path, [{"messages": msgs}])).train[0]
    assert "".join(_targets(tokenizer, ex)) == "Hello.<|im_end|>Bye.<|im_end|>"


def test_chat_template_without_generation_tags_gives_the_same_mask(tokenizer, tmp_path):
    longer = CHAT["messages"] + [{"role": "user", "content": "More"}, {"role": "assistant", "content": "No."}]
    path = _jsonl(tmp_path, [CHAT, {"messages": longer}])
    tagged = _load(tokenizer, path).train
    plain = AutoTokenizer.from_pretrained(ensure_builtin("builtin:tiny-llama"))
    plain.chat_template = plain.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    untagged = _load(plain, path).train
    assert [(e.input_ids, e.labels) for e in untagged] == [(e.input_ids, e.labels) for e in tagged]


def test_full_loss_trains_every_token_but_the_first(tokenizer, tmp_path):
    ex = _load(tokenizer, _jsonl(tmp_path, [CHAT]), completion_only_loss=False).train[0]
    assert ex.labels[0] == IGNORE_INDEX and ex.labels[1:] == ex.input_ids[1:]


def test_prompt_completion_with_mapped_field_names(tokenizer, tmp_path):
    path = _jsonl(tmp_path, [{"q": "What is 2 plus 2?", "a": " 4"}])
    ex = _load(tokenizer, path, format="prompt_completion", prompt_field="q", completion_field="a").train[0]
    n_prompt = len(tokenizer("What is 2 plus 2?")["input_ids"])
    assert all(lab == IGNORE_INDEX for lab in ex.labels[:n_prompt])
    assert ex.labels[n_prompt:] == ex.input_ids[n_prompt:]
    assert ex.input_ids[-1] == tokenizer.eos_token_id


def test_text_format_is_detected_and_trains_on_all_tokens(tokenizer, tmp_path):
    data = _load(tokenizer, _jsonl(tmp_path, [{"text": "hello world"}]))
    ex = data.train[0]
    assert data.format == "text" and ex.labels[1:] == ex.input_ids[1:]
    assert ex.input_ids[-1] == tokenizer.eos_token_id


def test_overlong_examples_are_truncated_or_dropped_and_counted(tokenizer, tmp_path):
    long_text = {"text": "the word bridge has six letters " * 20}
    path = _jsonl(tmp_path, [long_text, {"text": "short"}])
    truncated = _load(tokenizer, path, max_seq_length=16)
    assert truncated.counts.truncated == 1 and max(len(e.input_ids) for e in truncated.train) == 16
    dropped = _load(tokenizer, path, max_seq_length=16, overlong="drop")
    assert dropped.counts.dropped_overlong == 1 and len(dropped.train) == 1


def test_truncation_that_removes_every_target_drops_the_example(tokenizer, tmp_path):
    long_user = {"messages": [{"role": "user", "content": "x " * 100}, {"role": "assistant", "content": "ok"}]}
    data = _load(tokenizer, _jsonl(tmp_path, [long_user, CHAT]), max_seq_length=32)
    assert data.counts.dropped_no_targets == 1 and len(data.train) == 1


def test_split_is_deterministic_and_sized(tokenizer):
    spec = DataSpec(path=str(DATA_FILE), eval_fraction=0.1)
    a, b = load_examples(spec, tokenizer), load_examples(spec, tokenizer)
    assert len(a.eval) == round(284 * 0.1) and len(a.train) + len(a.eval) == 284
    assert [e.input_ids for e in a.eval] == [e.input_ids for e in b.eval]


def test_json_list_file_reports_the_line_of_a_bad_record(tokenizer, tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"text": "ok"},\n  {"text": "fine"},\n  {"txt": 3}\n]\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"{path}:4: field 'text': missing"):
        _load(tokenizer, path, format="text")


@pytest.mark.parametrize(
    "content, line, field",
    [
        ([CHAT, '{"messages": [}'], 2, "(record)"),  # bad JSON
        ([CHAT, CHAT, {"prompt": "x"}], 3, "'messages'"),  # missing field
        ([CHAT, {"messages": [{"role": "user", "content": 5}]}], 2, "'messages[0].content'"),  # wrong type
    ],
)
def test_malformed_record_names_file_line_and_field(tokenizer, tmp_path, content, line, field):
    path = _jsonl(tmp_path, content)
    with pytest.raises(DataError) as err:
        _load(tokenizer, path, format="messages")
    assert f"{path}:{line}: field {field}" in str(err.value) and "on_bad_record: skip" in str(err.value)


def test_non_utf8_line_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(CHAT).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: field \(record\): byte .* not UTF-8"):
        _load(tokenizer, path)


def test_empty_file_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"{path}:1: .*empty"):
        _load(tokenizer, path)


def test_skip_mode_counts_malformed_records(tokenizer, tmp_path):
    path = _jsonl(tmp_path, [CHAT, "{not json", {"messages": "hi"}, CHAT])
    data = _load(tokenizer, path, on_bad_record="skip")
    assert data.counts.records == 4 and data.counts.skipped_malformed == 2 and len(data.train) == 2
    assert data.counts.skipped_problems[0].startswith(f"{path}:2:")


def test_parquet_file(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq  # in the test extra, so this always runs

    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "hello world"}, {"text": "the capital of France"}]), good)
    assert _load(tokenizer, good).counts.records == 2
    path = tmp_path / "d.parquet"  # a column has one type, so a bad row is a null
    pq.write_table(pa.Table.from_pylist([{"text": "hello"}, {"text": None}]), path)
    with pytest.raises(DataError, match="row 2: field 'text'"):
        _load(tokenizer, path)
