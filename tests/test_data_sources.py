"""data.sources: several files mixed by weight, each split on its own, counted per source."""

import json

import pytest
import yaml

from slimtune.data import load_examples
from slimtune.models.tiny import DATA_FILE, build_tokenizer
from slimtune.report.run_report import render_markdown
from slimtune.spec.schema import DataSpec, SpecError, load_spec


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def files(tmp_path):
    pc = tmp_path / "pc.jsonl"
    pc.write_text(
        "\n".join(json.dumps({"q": f"What is {i} plus 1?", "a": f"It is {i + 1}."}) for i in range(40)) + "\n"
    )
    return DATA_FILE, pc


def test_weights_repeat_and_subsample_each_sources_train_part(files, tokenizer):
    chat, pc = files
    data = DataSpec(
        max_seq_length=128,
        eval_fraction=0.1,
        sources=[
            {"path": str(chat), "weight": 0.5},
            {
                "path": str(pc),
                "weight": 2.5,
                "format": "prompt_completion",
                "prompt_field": "q",
                "completion_field": "a",
            },
        ],
    )
    ex = load_examples(data, tokenizer)
    first, second = ex.summary()["sources"]
    assert (first["format"], second["format"]) == ("messages", "prompt_completion") and ex.format == "mixed"
    alone = [
        load_examples(data.model_copy(update={"sources": None, "path": str(chat)}), tokenizer),
        load_examples(
            data.model_copy(
                update={
                    "sources": None,
                    "path": str(pc),
                    "format": "prompt_completion",
                    "prompt_field": "q",
                    "completion_field": "a",
                }
            ),
            tokenizer,
        ),
    ]
    for src, single, weight in zip((first, second), alone, (0.5, 2.5)):
        assert src["records"] == single.counts.records
        assert src["train_examples"] == len(single.train) and src["eval_examples"] == len(single.eval)
        assert src["train_examples_used"] == int(weight) * len(single.train) + round((weight % 1) * len(single.train))
    assert len(ex.train) == first["train_examples_used"] + second["train_examples_used"]
    assert len(ex.eval) == first["eval_examples"] + second["eval_examples"]  # held-out examples are not weighted
    assert ex.counts.records == first["records"] + second["records"]
    held = {tuple(e.input_ids) for e in ex.eval}
    assert not held & {tuple(e.input_ids) for e in ex.train}, "an up-weighted example must not also be held out"


def test_report_lists_each_source(files, tokenizer):
    chat, pc = files
    data = DataSpec(sources=[{"path": str(chat)}, {"path": str(chat), "weight": 2}], max_seq_length=128)
    summary = {"spec": {}, "packed_sft": {"steps": 1, "data": load_examples(data, tokenizer).summary()}}
    markdown = render_markdown(summary)
    assert "### data sources" in markdown and markdown.count(str(chat)) >= 2


def test_sources_paths_resolve_against_the_spec_folder_and_missing_ones_are_named(tmp_path, files):
    chat, _ = files
    (tmp_path / "a.jsonl").write_text(chat.read_text())
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"data": {"sources": [{"path": "a.jsonl", "weight": 2}]}}))
    spec = load_spec(spec_file)
    assert spec.data.sources[0].path == str((tmp_path / "a.jsonl").resolve())
    spec_file.write_text(yaml.safe_dump({"data": {"sources": [{"path": "a.jsonl"}, {"path": "gone.jsonl"}]}}))
    with pytest.raises(SpecError) as err:
        load_spec(spec_file)
    assert [p.split(":")[0] for p in err.value.problems] == ["data.sources.1.path"]
    spec_file.write_text(yaml.safe_dump({"data": {"sources": [{"path": "a.jsonl", "weight": 0}]}}))
    with pytest.raises(SpecError, match=r"data\.sources\.0\.weight"):
        load_spec(spec_file)


def test_a_single_data_path_still_works(tokenizer):
    ex = load_examples(DataSpec(path=str(DATA_FILE), max_seq_length=128), tokenizer)
    assert ex.format == "messages" and "sources" not in ex.summary()
