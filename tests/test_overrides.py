"""`--set a.b=value` overrides, `--version`, and `validate`'s YAML/JSON output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slimtune import __version__
from slimtune.spec.overrides import apply_overrides, effective_yaml
from slimtune.spec.schema import SpecError, load_spec

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "deployments" / "tiny.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", *args], capture_output=True, text=True, timeout=300
    )


def test_overrides_set_nested_values_parsed_as_yaml():
    out = apply_overrides(
        {"lora": {"r": 16}},
        ["lora.r=32", "train.learning_rate=1.0e-4", "export.gguf=[f16, q8_0]", "export.push.repo_id=me/x"],
    )
    assert out["lora"]["r"] == 32
    assert out["train"]["learning_rate"] == 1e-4
    assert out["export"]["gguf"] == ["f16", "q8_0"]
    assert out["export"]["push"] == {"repo_id": "me/x"}


def test_the_original_mapping_is_left_alone():
    data = {"lora": {"r": 16}}
    apply_overrides(data, ["lora.r=8"])
    assert data == {"lora": {"r": 16}}


def test_load_spec_applies_overrides_in_order_and_validates_them():
    spec = load_spec(TINY, ["lora.r=32", "lora.r=8", "train.max_steps=3", "name=other", "train.learning_rate=1e-4"])
    # YAML reads 1e-4 as a string, as it does in the file; the spec converts it the same way for both.
    assert (spec.lora.r, spec.train.max_steps, spec.name, spec.train.learning_rate) == (8, 3, "other", 1e-4)
    with pytest.raises(SpecError) as err:
        load_spec(TINY, ["lora.r=0"])
    assert any(p.startswith("lora.r: got 0") for p in err.value.problems)


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        ("lora.rr=32", "unknown field 'lora.rr'; lora has r, alpha"),
        ("loar.r=32", "unknown field 'loar'; the spec has name, output_dir"),
        ("lora.r.x=1", "lora.r is a value, not a section"),
        ("lora.r", "expected a dotted field path and a value"),
        ("lora.r=[1", "the value is not valid YAML"),
    ],
)
def test_bad_overrides_are_errors_naming_the_path(assignment, expected):
    with pytest.raises(SpecError) as err:
        apply_overrides({}, [assignment])
    assert len(err.value.problems) == 1
    assert expected in err.value.problems[0] and assignment in err.value.problems[0]


def test_every_bad_override_is_reported_together():
    with pytest.raises(SpecError) as err:
        apply_overrides({}, ["lora.rr=1", "train.lr=2", "lora.r=4"])
    assert len(err.value.problems) == 2


def test_effective_yaml_round_trips_to_the_same_spec():
    spec = load_spec(TINY, ["lora.r=4", "export.gguf=[q8_0]"])
    again = yaml.safe_load(effective_yaml(spec))
    assert again == spec.model_dump(mode="json")


def test_cli_version():
    res = _cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"slimtune {__version__}"


def test_cli_validate_prints_yaml_by_default_and_json_on_request():
    as_yaml = _cli("validate", str(TINY), "--set", "lora.r=4")
    as_json = _cli("validate", str(TINY), "--json", "--set", "lora.r=4")
    assert as_yaml.returncode == 0 and as_json.returncode == 0, as_yaml.stderr + as_json.stderr
    assert yaml.safe_load(as_yaml.stdout) == json.loads(as_json.stdout)
    assert json.loads(as_json.stdout)["lora"]["r"] == 4
    assert not as_yaml.stdout.lstrip().startswith("{")


def test_cli_unknown_override_exits_2_naming_it():
    res = _cli("validate", str(TINY), "--set", "train.lr=1e-4")
    assert res.returncode == 2
    assert "unknown field 'train.lr'" in res.stderr and "learning_rate" in res.stderr


def test_plan_takes_set_overrides_like_run_and_validate(capsys):
    from slimtune.cli.main import main

    args = ["plan", str(TINY), "--gpu-memory", "16GiB", "--host-memory", "64GiB"]
    assert main(args) == 0
    assert "micro-batch 4 x 256 tokens" in capsys.readouterr().out  # as in the file
    overrides = ["--set", "train.micro_batch_size=3", "--set", "data.max_seq_length=128", "--set", "model.device=auto"]
    assert main([*args, *overrides]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 3 x 128 tokens" in out and "CUDA context" in out  # planned for a GPU, not the file's CPU
    assert main([*args, "--set", "train.lr=1e-4"]) == 2
    assert "unknown field 'train.lr'" in capsys.readouterr().err
