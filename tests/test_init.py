"""`slimtune init`: a commented spec proposed from the tiny model and real data files, validated by load_spec."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from slimtune.cli.scaffold import ScaffoldError, scaffold_spec
from slimtune.cli.sizes import parse_size
from slimtune.models.tiny import DATA_FILE, ensure_builtin, save_tiny
from slimtune.spec.schema import load_spec

MODEL = "builtin:tiny-llama"


def _fields(text: str) -> list[str]:
    """Lines of the spec that set a value (not section headers, not comment lines)."""
    return [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#") and not ln.endswith(":")]


def test_proposed_spec_validates_and_comments_every_field(tmp_path):
    text = scaffold_spec(MODEL, str(DATA_FILE))
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    spec = load_spec(path)
    assert spec.model.name_or_path == MODEL and spec.data.format == "messages"
    assert all("  # " in line for line in _fields(text)), [ln for ln in _fields(text) if "  # " not in ln]
    assert "family llama" in text and "has a chat template" in text


def test_max_seq_length_covers_the_data(tmp_path):
    from transformers import AutoTokenizer

    from slimtune.data import load_examples
    from slimtune.spec.schema import DataSpec

    spec = yaml.safe_load(scaffold_spec(MODEL, str(DATA_FILE)))
    seq = spec["data"]["max_seq_length"]
    tok = AutoTokenizer.from_pretrained(ensure_builtin(MODEL))
    lengths = [len(e.input_ids) for e in load_examples(DataSpec(path=str(DATA_FILE), max_seq_length=4096), tok).train]
    assert max(lengths) <= seq < max(lengths) + 64 or seq == 64  # the next multiple of 64, at least 64


def test_more_gpu_memory_never_proposes_a_smaller_micro_batch(tmp_path):
    # enough records for 50 optimizer steps of 16 rows, so that the small-data proposal does not apply
    data = tmp_path / "chat.jsonl"
    data.write_text(DATA_FILE.read_text(encoding="utf-8") * 7, encoding="utf-8")
    small = yaml.safe_load(scaffold_spec(MODEL, str(data), gpu_memory=parse_size("64MiB")))["train"]
    large = yaml.safe_load(scaffold_spec(MODEL, str(data), gpu_memory=parse_size("16GiB")))["train"]
    assert small["micro_batch_size"] < large["micro_batch_size"]
    for t in (small, large):  # accumulation keeps the optimizer batch at the spec's effective batch, 16 rows
        assert t["micro_batch_size"] * t["gradient_accumulation_steps"] == 16


def test_init_proposes_the_micro_batch_plan_chooses(tmp_path, capsys):
    """init, `slimtune plan` and `micro_batch_size: auto` share one fitting rule, so they cannot disagree: the
    largest micro-batch that runs (a tight fit included), or a smaller one with CUDA graphs where that is predicted
    faster, up to the first of 8192 tokens or more (the rest goes to stored layers)."""
    from slimtune.cli.main import main

    # An 8B-shaped config.json with the tiny tokenizer: init and plan read no weights, and at this size
    # the budgets below give different answers (the tiny model fits 16 rows in any budget that fits 1).
    model_dir = save_tiny(tmp_path / "m")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
    cfg.update(num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "long.jsonl"  # ~1750 tokens a record: activations matter
    data.write_text(
        "".join(json.dumps({"text": " ".join(f"w{i * j % 97}" for j in range(700))}) + "\n" for i in range(8))
    )
    proposals = {}
    for budget in ("5GiB", "6GiB", "8GiB", "9GiB"):
        assert main(["init", "--model", str(model_dir), "--data", str(data), "--gpu-memory", budget]) == 0
        spec = tmp_path / f"{budget}.yaml"
        spec.write_text(capsys.readouterr().out)
        proposals[budget] = yaml.safe_load(spec.read_text())["train"]["micro_batch_size"]
        comment = next(line for line in spec.read_text().splitlines() if "micro_batch_size:" in line)
        assert comment.split("# ")[1].startswith(("the largest divisor", "the first divisor")), comment  # auto's reason
        assert "as in `slimtune plan`" in comment and "accumulation" not in comment, comment
        main(["plan", str(spec), "--gpu-memory", budget, "--set", "train.micro_batch_size=auto"])
        out = capsys.readouterr().out.splitlines()  # "plan for NAME: MODEL, micro-batch X x N tokens, ..."
        chosen = int(out[0].split("micro-batch ")[1].split(" x ")[0])
        reported = next(line for line in out if line.startswith("largest micro-batch that runs"))
        largest = reported.split(": ")[1].split(";")[0]
        seq = yaml.safe_load(spec.read_text())["data"]["max_seq_length"]
        bound = next(d for d in (1, 2, 4, 8, 16) if d * seq >= 8192)
        graphs_on = any(line.startswith("speed within the budget: CUDA graphs on") for line in out)
        expected = min(1 if largest == "none" else int(largest), bound)
        # a smaller micro-batch only where it keeps the CUDA graphs that the larger one has no room for
        assert proposals[budget] == chosen == expected or (chosen < expected and graphs_on), (budget, out)
    assert len(set(proposals.values())) >= 3, proposals  # the budgets did discriminate


def test_prompt_completion_and_text_data_are_detected(tmp_path):
    pc = tmp_path / "pc.jsonl"
    pc.write_text("\n".join(json.dumps({"prompt": f"Q{i}?", "completion": f"A{i}."}) for i in range(30)) + "\n")
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"line {i} of plain text"}) for i in range(5)) + "\n")
    assert yaml.safe_load(scaffold_spec(MODEL, str(pc)))["data"]["format"] == "prompt_completion"
    proposed = yaml.safe_load(scaffold_spec(MODEL, str(text)))
    assert proposed["data"]["format"] == "text" and proposed["data"]["eval_fraction"] == 0.0  # 5 records


def test_chat_data_on_a_tokenizer_without_template_is_refused(tmp_path):
    from transformers import AutoTokenizer

    model_dir = save_tiny(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = None
    tok.save_pretrained(model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ScaffoldError, match="no chat template"):
        scaffold_spec(str(model_dir), str(DATA_FILE))


def test_cli_init_writes_the_spec_to_stdout_and_bad_input_exits_2(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", "init", "--model", MODEL, "--data", str(DATA_FILE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "spec.yaml").write_text(ok.stdout)
    assert load_spec(tmp_path / "spec.yaml").data.path == str(DATA_FILE.resolve())
    for args, field in (
        (["--data", str(tmp_path / "missing.jsonl")], "--data"),
        (["--data", str(DATA_FILE), "--model", str(tmp_path / "nope")], "--model"),
    ):
        model = [] if "--model" in args else ["--model", MODEL]
        bad = subprocess.run(
            [sys.executable, "-m", "slimtune.cli.main", "init", *model, *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bad.returncode == 2 and f"slimtune: error: ScaffoldError: {field}" in bad.stderr, bad.stderr
    # A size is checked by argparse with the planner's rule (slimtune.cli.sizes), before anything is read.
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimtune.cli.main",
            "init",
            "--model",
            MODEL,
            "--data",
            str(DATA_FILE),
            "--gpu-memory",
            "lots",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "argument --gpu-memory: 'lots' is not a size" in bad.stderr, bad.stderr


def test_small_data_gets_enough_optimizer_steps_and_a_relative_path(tmp_path, monkeypatch):
    """80 chat records used to get 4 optimizer steps (16 rows a step, one pass) and an absolute data path: now
    fewer rows a step and more passes, up to 3, for ~50 steps; the path is relative to where the spec is saved."""
    import math

    (tmp_path / "data").mkdir()
    small = tmp_path / "data" / "small.jsonl"
    small.write_text("\n".join(DATA_FILE.read_text(encoding="utf-8").splitlines()[:80]) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    text = scaffold_spec(MODEL, str(small))
    proposed = yaml.safe_load(text)
    assert proposed["data"]["path"] == "data/small.jsonl"
    (tmp_path / "spec.yaml").write_text(text)
    spec = load_spec(tmp_path / "spec.yaml")  # the relative path resolves against the spec's folder
    assert spec.data.path == str(small.resolve())
    train, seq = proposed["train"], proposed["data"]["max_seq_length"]
    rows = int(re.search(r"~(\d+) packed rows", text).group(1))
    assert rows <= math.ceil(80 * 0.9 * seq / seq)  # at most one row per record: the records are shorter than seq
    steps = math.ceil(rows / (train["micro_batch_size"] * train["gradient_accumulation_steps"])) * train["epochs"]
    assert 30 <= steps and train["epochs"] <= 3, (steps, train)
    assert f"~{steps} optimizer steps" in text
    elsewhere = scaffold_spec(MODEL, str(DATA_FILE))  # a file outside the working directory keeps its full path
    assert yaml.safe_load(elsewhere)["data"]["path"] == str(DATA_FILE.resolve())
