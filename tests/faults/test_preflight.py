"""Bad input the spec's own validation cannot see, and YAML that loses settings: exit 2 before any model loads.

Each case goes through the CLI (`slimtune validate` and `slimtune run`) and must end with exit code 2, name
the field or file and the fix, and (when this process has not imported it already) never import the flow.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from faultlib import spec_dict

from slimtune.cli.main import EXIT_INVALID_SPEC, main
from slimtune.models.tiny import save_tiny

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("model") / "tiny", "llama", **_SMALL)


def _cli(command: str, spec: Path, capsys) -> tuple[int, str]:
    loaded = "slimtune.flows.finetune" in sys.modules
    code = main([command, str(spec)])
    err = capsys.readouterr().err
    if not loaded:
        assert "slimtune.flows.finetune" not in sys.modules, "the flow was imported for a bad spec"
    return code, err


def _spec_file(tmp_path: Path, **overrides) -> Path:
    data = spec_dict(tmp_path / "runs", **{k: v for k, v in overrides.items() if k != "output_dir"})
    data["output_dir"] = str(overrides.get("output_dir", data["output_dir"]))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _broken_model(model_dir: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    broken = tmp_path / "broken-model"
    shutil.copytree(model_dir, broken)
    (broken / name).write_bytes(content)
    return broken


# (case, spec changes or a builder given (tmp_path, model_dir), text the message must contain)
_CASES = [
    ("push repo id with a space", {"export": {"push": {"repo_id": "my org/model"}}}, "export.push.repo_id"),
    ("lora target that is not in the model", {"lora": {"target_modules": ["q_proj", "qkv"]}}, "choose from"),
    ("output_dir is a file", lambda t, m: {"output_dir": str(_file(t))}, "output_dir"),
    (
        "broken config.json",
        lambda t, m: {"model": {"name_or_path": str(_broken_model(m, t, "config.json", b"{"))}},
        "config.json is not valid JSON",
    ),
    (
        "broken tokenizer.json",
        lambda t, m: {"model": {"name_or_path": str(_broken_model(m, t, "tokenizer.json", b'{"a": '))}},
        "tokenizer.json is not valid JSON",
    ),
    ("data file not UTF-8", lambda t, m: {"data": {"path": str(_latin1(t))}}, "data.path"),
    ("lora.r given as true", {"lora": {"r": True}}, "lora.r"),
    ("train.resume given as 1", {"train": {"resume": 1}}, "train.resume"),
]


def _file(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile"


def _latin1(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    return path


@pytest.mark.fault(
    "Bad input: found before any model loads",
    stage="spec",
    expect="exit 2 from validate and run, naming the field or file and the fix; no model stage imported",
)
@pytest.mark.parametrize("case,changes,needle", _CASES, ids=[c[0] for c in _CASES])
def test_bad_input_exits_2_before_loading(case, changes, needle, tmp_path, model_dir, capsys, observe):
    overrides = changes(tmp_path, model_dir) if callable(changes) else changes
    spec = _spec_file(tmp_path, **overrides)
    for command in ("validate", "run"):
        code, err = _cli(command, spec, capsys)
        assert code == EXIT_INVALID_SPEC, err
        assert needle in err, err
    observe(next(line.strip() for line in err.splitlines() if needle in line).replace(str(tmp_path), "…")[:200])


@pytest.mark.fault("Bad input: found before any model loads", stage="spec", expect="model.device cuda without a GPU")
def test_cuda_without_gpu(tmp_path, capsys, observe):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    code, err = _cli("validate", _spec_file(tmp_path, model={"device": "cuda"}), capsys)
    assert code == EXIT_INVALID_SPEC and "model.device" in err and "use model.device: cpu" in err
    observe(err.splitlines()[1].strip())


@pytest.mark.fault("Bad input: found before any model loads", stage="spec", expect="unwritable output_dir")
def test_unwritable_output_dir(tmp_path, capsys, observe):
    if os.geteuid() == 0:
        pytest.skip("root writes everywhere; run as a user to test permissions")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, err = _cli("validate", _spec_file(tmp_path, output_dir=str(locked / "runs")), capsys)
    assert code == EXIT_INVALID_SPEC and "output_dir" in err and "not writable" in err
    observe(err.splitlines()[1].strip())


# (case, spec file bytes, text the message must contain)
_YAML_CASES = [
    ("duplicate section", b"name: a\nlora:\n  r: 8\nlora:\n  alpha: 32\n", "key 'lora' appears twice (lines 2 and 4)"),
    ("duplicate key", b"train:\n  seed: 1\n  seed: 2\n", "key 'seed' appears twice (lines 2 and 3)"),
    ("not UTF-8", "name: caf\u00e9\n".encode("latin-1"), "not UTF-8"),
    ("empty", b"", "the spec is empty"),
]


@pytest.mark.fault(
    "Bad input: YAML that would lose settings",
    stage="spec",
    expect="duplicate keys (with both lines), non-UTF-8 and empty specs are refused with exit 2",
)
@pytest.mark.parametrize("case,content,needle", _YAML_CASES, ids=[c[0] for c in _YAML_CASES])
def test_yaml_that_would_lose_settings(case, content, needle, tmp_path, capsys, observe):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(content)
    code, err = _cli("validate", spec, capsys)
    assert code == EXIT_INVALID_SPEC and needle in err, err
    assert "Traceback" not in err
    observe(next(line.strip() for line in err.splitlines() if needle in line)[:200])


@pytest.mark.fault(
    "Bad input: a broken data line",
    stage="data",
    expect="`slimtune run` exits 2 before loading, naming file:line; no traceback without --debug",
)
def test_data_error_is_named_by_file_and_line_without_traceback(tmp_path, observe):
    """The flow's own data loader named it once the run had started; the pre-run checks read the data as the
    flow does (`slimtune.checks.tokenizer_and_data`), so the run now stops before the flow with the same file:line."""
    import subprocess

    from faultlib import DATA, REPO

    data = tmp_path / "chat.jsonl"
    lines = DATA.read_text(encoding="utf-8").splitlines()[:20]
    data.write_text("\n".join(lines[:5] + ['{"messages": [{"role": "user"'] + lines[5:]) + "\n", encoding="utf-8")
    spec = _spec_file(tmp_path, data={"path": str(data)})
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", "run", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("slimtune: error:")]
    named = [line.strip() for line in done.stderr.splitlines() if f"{data}:6" in line]
    assert done.returncode == EXIT_INVALID_SPEC, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Beginning flow run" not in done.stderr, done.stderr[-3000:]
    assert len(errors) == 1 and len(named) == 1 and named[0].startswith(f"- {data}:6:"), done.stderr[-3000:]
    observe(named[0].replace(str(tmp_path), "…")[:200])
