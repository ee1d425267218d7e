"""What a run tells the user about its GGUF before and after it: the tokenizer check for a Hub model (after its
tokenizer files download, before its weights), a quiet `slimtune validate`, the run report's chat-template
outcome, and `tokenizer.chat_template` in every GGUF."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from slimtune.models.tiny import build_model, build_tokenizer, ensure_builtin
from slimtune.report.run_report import write_run_report
from slimtune.spec.schema import parse_spec
from slimtune.tasks.gguf_convert_and_push import gguf_convert_and_push

_HUB_ID = "acme/tiny-llama-lowercase"
# A template no Go template of the Modelfile reproduces: the report must say the Modelfile has no TEMPLATE
_ODD_TEMPLATE = "{% for m in messages %}### {{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}### ASSISTANT:"


def _inexact_tokenizer_files(folder: Path) -> None:
    """config.json and a tokenizer llama.cpp would read differently (a Lowercase normalizer), no weights."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder)
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Lowercase"}  # llama.cpp lower-cases nothing
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    build_model(
        "llama", len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1
    ).config.save_pretrained(folder)


def _hub_cache(hf_home: Path, repo_id: str) -> Path:
    """An HF cache under `hf_home` holding `repo_id` at main as huggingface_hub lays it out (refs + snapshot)."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot


def _spec_file(tmp_path: Path, model: str, export: str = "{gguf: [f16, q8_0]}") -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(
        f"name: t\nmodel: {{name_or_path: {model}, device: cpu}}\ndata: {{path: {data}}}\n"
        f"output_dir: {tmp_path / 'out'}\nexport: {export}\n"
    )
    return spec


def _slimtune(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize("command", ["validate", "run"])
def test_hub_model_tokenizer_is_refused_before_its_weights_load(command, tmp_path):
    """A Hub id whose cache holds config.json and the tokenizer but no weights: validate and run exit 2 with
    the tokenizer's one line. A check after the tokenizer download but at load time would fail on the missing
    weights instead, and one skipped for Hub ids would let validate pass."""
    hf_home = tmp_path / "hf"
    _inexact_tokenizer_files(_hub_cache(hf_home, _HUB_ID))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    done = _slimtune(command, str(_spec_file(tmp_path, _HUB_ID)), env=env)
    assert done.returncode == 2, done.stderr
    problem = [line for line in done.stderr.splitlines() if line.startswith("- ") or "export.gguf" in line]
    assert any("export.gguf: the tokenizer cannot be written to GGUF with identical ids" in p for p in problem), (
        done.stderr
    )
    assert "gguf_tokenizer: as_is" in done.stderr
    assert not (tmp_path / "out").exists()  # stopped before the run started: no run dir, no training


def test_validate_of_a_gguf_export_prints_nothing_from_llama_cpp(tmp_path):
    """The tokenizer check loads a vocab-only GGUF in llama.cpp, whose context prints "n_ctx_seq (512) >
    n_ctx_train (0)" even with verbose=False: stderr holds only slimtune's own line."""
    spec = _spec_file(tmp_path, "builtin:tiny-llama")
    done = _slimtune("validate", str(spec))
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"slimtune: {spec} is valid"]
    assert "name: t" in done.stdout and "llama_context" not in done.stdout


def _export(tmp_path: Path, model_dir: Path) -> tuple[dict, Path]:
    """gguf_convert_and_push on `model_dir` as the merged model, and the run report written from its result."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    spec = parse_spec(
        {
            "name": "r",
            "model": {"name_or_path": "builtin:tiny-llama", "device": "cpu"},
            "data": {"path": str(data)},
            "output_dir": str(tmp_path / "out"),
            "export": {"gguf": ["f16"], "verify": False},
        }
    )
    summary = {"spec": spec.model_dump(mode="json"), "train": {"steps": 1}}
    result = gguf_convert_and_push(spec, model_dir, tmp_path / "adapter", summary).to_dict()
    spec.run_dir().mkdir(parents=True, exist_ok=True)
    report = write_run_report(spec.run_dir(), {**summary, "gguf_convert_and_push": result})
    return result, report


def test_report_names_the_modelfile_chat_format_and_the_gguf_carries_the_template(tmp_path):
    model_dir = ensure_builtin("builtin:tiny-llama")  # a ChatML template
    result, report = _export(tmp_path, model_dir)
    assert result["chat_template"] == {"format": "ChatML"}
    assert json.loads(report.read_text())["gguf_convert_and_push"]["chat_template"] == {"format": "ChatML"}
    assert "Modelfile TEMPLATE: ChatML chat format." in report.with_name("report.md").read_text()
    reader = gguf.GGUFReader(tmp_path / "out" / "r" / "gguf" / "r-f16.gguf")
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == (model_dir / "chat_template.jinja").read_text()


def test_report_says_when_the_modelfile_has_no_template_and_how_to_chat(tmp_path):
    model_dir = tmp_path / "merged"
    shutil.copytree(ensure_builtin("builtin:tiny-llama"), model_dir)
    (model_dir / "chat_template.jinja").write_text(_ODD_TEMPLATE)
    result, report = _export(tmp_path, model_dir)
    outcome = result["chat_template"]
    assert outcome["format"] == "none" and "no Go template reproduces it" in outcome["reason"]
    assert "llama-cli -m r-f16.gguf --jinja" in outcome["run_with"]
    assert json.loads(report.read_text())["gguf_convert_and_push"]["chat_template"] == outcome
    markdown = report.with_name("report.md").read_text()
    assert "Modelfile TEMPLATE: none; the chat template matches none of" in markdown
    assert "Chat with it through: llama-cli -m r-f16.gguf --jinja" in markdown
    modelfile = (tmp_path / "out" / "r" / "gguf" / "Modelfile").read_text().splitlines()
    assert not [line for line in modelfile if line.startswith("TEMPLATE")]
    reader = gguf.GGUFReader(tmp_path / "out" / "r" / "gguf" / "r-f16.gguf")
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == _ODD_TEMPLATE
