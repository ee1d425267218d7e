"""The spec rejects bad input before any model is loaded, one line per problem naming field and fix."""

from pathlib import Path

import pytest

from slimtune.spec.schema import PipelineSpec, SpecError, load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
DATA = str(ROOT / "deployments" / "data" / "tiny_chat.jsonl")


def _problems(raw: dict) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_spec(raw, base_dir=ROOT)
    return e.value.problems


@pytest.mark.parametrize(
    "raw, field, hint",
    [
        ({"lora": {"r": 0}}, "lora.r", "greater than 0"),
        ({"lora": {"r": "sixteen"}}, "lora.r", "valid integer"),
        ({"lora": {"dropout": 1.0}}, "lora.dropout", "less than 1"),
        ({"lora": {"target_modules": []}}, "lora.target_modules", "non-empty list"),
        ({"lora": {"gradient_checkpointing": "sometimes"}}, "lora.gradient_checkpointing", "unsloth"),
        ({"merge": {"maximum_memory_usage": 0}}, "merge.maximum_memory_usage", "greater than 0"),
        ({"merge": {"maximum_memory_usage": 0.96}}, "merge.maximum_memory_usage", "less than or equal to 0.95"),
        ({"merge": {"source": "magic"}}, "merge.source", "'dequantized'"),
        ({"train": {"micro_batch_size": -1}}, "train.micro_batch_size", "greater than 0"),
        ({"train": {"learning_rate": 0}}, "train.learning_rate", "greater than 0"),
        ({"train": {"stored_layers": -1}}, "train", "train.stored_layers is -1: it must be 0 or more"),
        ({"train": {"stored_layers": 4, "num_gpus": 2}}, "train", "on one GPU only (every rank recomputes"),
        ({"train": {"optimizer": "sgd"}}, "train.optimizer", "adamw_torch"),
        ({"train": {"warmup": 10}}, "train.warmup", "unknown key"),
        ({"train": {"kernels": ["rms_norm", "flash"]}}, "train.kernels", "unknown kernel(s) ['flash']"),
        ({"trainer": {}}, "trainer", "unknown key"),
        ({"data": {"path": "missing.jsonl"}}, "data.path", "file not found"),
        ({"data": {"max_seq_length": 8}}, "data.max_seq_length", "greater than or equal to 16"),
        ({"data": {"eval_fraction": 0.5}}, "data.eval_fraction", "less than 0.5"),
        ({"model": {"device": "tpu"}}, "model.device", "cuda:N"),
        ({"model": {"name_or_path": "./no/such/dir"}}, "model.name_or_path", "not found"),
        ({"model": {"name_or_path": "builtin:tiny-gpt2"}}, "model.name_or_path", "builtin:tiny-llama"),
        ({"export": {"gguf": ["q9_z"]}}, "export.gguf", "unknown GGUF type"),
        ({"export": {"push": {"repo_id": "no-slash"}}}, "export.push.repo_id", "org/name"),
        ({"export": {"push": {}}}, "export.push.repo_id", "required"),
        ({"name": "has spaces"}, "name", "pattern"),
        ({"merge": {"enabled": False}}, "(top level)", "merge.enabled"),
        ({"guard": {"max_retries": 99}}, "guard.max_retries", "less than or equal to 10"),
    ],
)
def test_bad_spec_names_field_value_and_fix(raw, field, hint):
    raw.setdefault("data", {}).setdefault("path", DATA)
    problems = _problems(raw)
    assert len(problems) == 1, problems
    assert problems[0].startswith(field), problems
    assert hint in problems[0], problems


def test_every_problem_is_reported_at_once():
    problems = _problems(
        {
            "lora": {"r": 0, "alpha": -1},
            "merge": {"maximum_memory_usage": 2},
            "bogus": True,
            "data": {"path": "nope.jsonl"},
        }
    )
    fields = sorted(p.split(":")[0] for p in problems)
    assert fields == ["bogus", "data.path", "lora.alpha", "lora.r", "merge.maximum_memory_usage"]


def test_bad_value_is_shown():
    (problem,) = _problems({"merge": {"maximum_memory_usage": 1.5}, "data": {"path": DATA}})
    assert "got 1.5" in problem


def test_defaults_are_safe():
    spec = PipelineSpec()
    assert spec.model.trust_remote_code is False
    assert spec.model.allow_pickle is False
    assert spec.merge.maximum_memory_usage == 0.9
    assert spec.lora.gradient_checkpointing == "unsloth"


def test_gguf_aliases_resolve():
    spec = parse_spec({"data": {"path": DATA}, "export": {"gguf": ["not_quantized", "fast_quantized", "F16"]}})
    assert spec.export.gguf == ["f16", "q8_0"]


@pytest.mark.parametrize("path", sorted((ROOT / "deployments").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_validate(path):
    spec = load_spec(path)
    assert Path(spec.data.path).is_file()


def test_relative_paths_resolve_against_spec_folder(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "s.yaml").write_text("data:\n  path: d.jsonl\noutput_dir: out\n")
    spec = load_spec(tmp_path / "s.yaml")
    assert spec.data.path == str(tmp_path / "d.jsonl")
    assert spec.run_dir() == tmp_path / "out" / "tiny"


def test_yaml_errors_are_spec_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "absent.yaml")


def _schema_nodes(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schema_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schema_nodes(value)


def test_run_form_schema_has_no_const_null_default_or_internal_field():
    """Prefect's run form shows a `const` as "... is a const and cannot be changed" and a null branch as
    "Property is type None", fills every field that has a default (a `default: null` then fails "None is not
    of type ..."), shows every property (the crash hook's counter too) and renders help as Markdown (a <tag>
    vanishes). The flow's parameter schema must avoid all of these, and still admit what the flow accepts.
    (tests/test_ui_form.py submits the form itself.)"""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from slimtune.flows.finetune import finetune

    schema = parameter_schema(finetune.fn).model_dump()
    nodes = list(_schema_nodes(schema))
    sections = schema["definitions"]
    push = sections["ExportSpec"]["properties"]["push"]
    cluster = sections["TrainSpec"]["properties"]["cluster"]
    assert not [n for n in nodes if "const" in n]
    # The null branches: the optional sections (Push, the Ray cluster), each a choice that starts at "Off" (not a
    # half-filled section).
    assert [n for n in nodes if n.get("type") == "null"] == [{"type": "null", "title": "Off"}] * 2
    assert push["default"] is None and push["anyOf"][0] == {"$ref": "#/definitions/PushSpec"}
    assert cluster["default"] is None and cluster["anyOf"][0] == {"$ref": "#/definitions/ClusterSpec"}
    assert sorted(map(str, (n for n in nodes if "default" in n and n["default"] is None))) == sorted(
        map(str, (push, cluster))
    )
    targets = sections["LoraSpec"]["properties"]["target_modules"]
    assert {"enum": ["all-linear"], "type": "string"} in targets["anyOf"]
    max_steps = sections["TrainSpec"]["properties"]["max_steps"]
    assert max_steps["type"] == "integer" and "default" not in max_steps
    assert sections["TrainSpec"]["properties"]["learning_rate"]["type"] == "number"
    assert "resubmits" not in sections["PipelineSpec"]["properties"]
    assert not [n["description"] for n in nodes if "<" in str(n.get("description", ""))]  # Markdown would eat it
    # The model itself still accepts what the schema no longer spells out.
    spec = PipelineSpec.model_validate({"lora": {"target_modules": "all-linear"}, "train": {"max_steps": None}})
    assert spec.lora.target_modules == "all-linear" and spec.train.max_steps is None
    # The server's check (Prefect's own validate, as for a flow run with enforce_parameter_schema) admits a whole
    # spec with its nulls and a re-submitted run's counter, and still refuses an unknown key.
    full = PipelineSpec(resubmits=1).model_dump(mode="json")
    assert full["train"]["max_steps"] is None and full["export"]["push"] is None
    assert validate({"spec": full}, schema) == []
    assert validate({"spec": {**full, "trian": {}}}, schema)
