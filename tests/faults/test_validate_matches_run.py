"""`validate` runs every check `run` runs before the model loads: inputs that `run` refused only after the model
began loading or training (exit 1, no field named), or trained to NaN, now stop both commands with exit 2.

Classes: a config.json that disagrees with the weights, an index that disagrees with its shards, a folder with
no weights, a tokenizer larger than the embeddings, numbers outside their real range, data that leaves nothing
to train on. Both commands go through the CLI; `run` must stop before it even imports the flow.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from faultlib import DATA, spec_dict

from slimtune.cli.main import EXIT_INVALID_SPEC, main
from slimtune.models.tiny import save_tiny

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny model in one safetensors file, and the same saved as an index with several shards."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    single = save_tiny(root / "single", "llama", **_SMALL)
    sharded = root / "sharded"
    shutil.copytree(single, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    return {"single": single, "sharded": sharded}


def _copy(models: dict[str, Path], tmp_path: Path, which: str = "single") -> Path:
    out = tmp_path / f"model-{which}"
    shutil.copytree(models[which], out)
    return out


def _config(model_dir: Path, **changes) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, **changes}))
    return model_dir


def _index(model_dir: Path) -> tuple[Path, dict]:
    path = model_dir / "model.safetensors.index.json"
    return path, json.loads(path.read_text())


def _shard_missing(models, tmp_path) -> dict:
    model_dir = _copy(models, tmp_path, "sharded")
    _, index = _index(model_dir)
    (model_dir / sorted(set(index["weight_map"].values()))[-1]).unlink()
    return {"model": {"name_or_path": str(model_dir)}}


def _tensor_in_wrong_shard(models, tmp_path) -> dict:
    model_dir = _copy(models, tmp_path, "sharded")
    path, index = _index(model_dir)
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    path.write_text(json.dumps(index))
    return {"model": {"name_or_path": str(model_dir)}}


def _truncated(models, tmp_path) -> dict:
    model_dir = _copy(models, tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    return {"model": {"name_or_path": str(model_dir)}}


def _no_weights(models, tmp_path) -> dict:
    model_dir = _copy(models, tmp_path)
    (model_dir / "model.safetensors").unlink()
    return {"model": {"name_or_path": str(model_dir)}}


def _renamed_weights(models, tmp_path) -> dict:
    model_dir = _copy(models, tmp_path)
    (model_dir / "model.safetensors").rename(model_dir / "weights.safetensors")
    return {"model": {"name_or_path": str(model_dir)}}


def _more_tokens(models, tmp_path) -> dict:
    from transformers import AutoTokenizer

    model_dir = _copy(models, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<extra>"])
    tokenizer.save_pretrained(model_dir)
    return {"model": {"name_or_path": str(model_dir)}}


def _data(tmp_path: Path, lines: int) -> Path:
    path = tmp_path / "few.jsonl"
    path.write_text("\n".join(DATA.read_text(encoding="utf-8").splitlines()[:lines]) + "\n", encoding="utf-8")
    return path


# (case, builder of spec changes given (models, tmp_path), texts the problem line must contain)
_CASES: list[tuple[str, Callable[[dict, Path], dict], tuple[str, ...]]] = [
    (
        "config hidden_size disagrees with the weights",
        lambda m, t: {"model": {"name_or_path": str(_config(_copy(m, t), hidden_size=32, head_dim=16))}},
        ("does not match the weights", "hidden_size: 32, the weights say 64"),
    ),
    (
        "config has more layers than the weights",
        lambda m, t: {"model": {"name_or_path": str(_config(_copy(m, t), num_hidden_layers=3))}},
        ("lack", "model.layers.2.", "the weights hold 2 layers"),
    ),
    ("index names a missing shard", _shard_missing, ("model.safetensors.index.json", "not in")),
    ("index puts a tensor in a shard without it", _tensor_in_wrong_shard, ("do not hold them",)),
    ("truncated shard", _truncated, ("model.safetensors is truncated",)),
    ("no weight files", _no_weights, ("no weights (*.safetensors)",)),
    ("weights under a name transformers does not load", _renamed_weights, ("neither model.safetensors nor",)),
    ("tokenizer larger than the embeddings", _more_tokens, ("872 tokens", "869 embedding rows")),
    (
        "every example dropped as overlong",
        lambda m, t: {"data": {"path": str(_data(t, 20)), "max_seq_length": 16, "overlong": "drop"}},
        ("none of the 20 records", "raise data.max_seq_length"),
    ),
    (
        "source weights leave no example",
        lambda m, t: {"data": {"sources": [{"path": str(_data(t, 20)), "weight": 0.01}]}},
        ("data.sources: the weights leave no training example", "x 0.01"),
    ),
    ("lora.alpha infinite", lambda m, t: {"lora": {"alpha": float("inf")}}, ("lora.alpha", "finite number")),
    (  # int(inf * 1e9) raised OverflowError in the merge, after training
        "merge shard size infinite",
        lambda m, t: {"merge": {"max_shard_size_gb": float("inf")}},
        ("merge.max_shard_size_gb", "finite number"),
    ),
    ("seed past numpy's range", lambda m, t: {"train": {"seed": 2**32}}, ("train.seed", "4294967295")),
    (
        "merge shard size rounding to 0 bytes",
        lambda m, t: {"merge": {"max_shard_size_gb": 1e-10}},
        ("merge.max_shard_size_gb", "0.001"),
    ),
]


def _cli(command: str, spec: Path, capsys) -> tuple[int, str]:
    loaded = "slimtune.flows.finetune" in sys.modules
    code = main([command, str(spec)])
    err = capsys.readouterr().err
    if not loaded:  # the flow (and with it every model stage) must not even be imported
        assert "slimtune.flows.finetune" not in sys.modules, "the flow was imported for a bad input"
    return code, err


@pytest.mark.fault(
    "Bad input: validate runs every check run runs",
    stage="spec",
    expect="exit 2 from validate and from run before any model loads, one line naming the field or file and the fix",
)
@pytest.mark.parametrize("case,build,needles", _CASES, ids=[c[0] for c in _CASES])
def test_validate_refuses_what_run_would_fail_on(case, build, needles, models, tmp_path, capsys, observe):
    data = spec_dict(tmp_path / "runs", **build(models, tmp_path))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    for command in ("validate", "run"):
        code, err = _cli(command, spec, capsys)
        assert code == EXIT_INVALID_SPEC, err
        line = next((ln for ln in err.splitlines() if all(n in ln for n in needles)), None)
        assert line is not None, f"{command}: no line with {needles}:\n{err}"
        assert "Traceback" not in err
    observe(line.strip().replace(str(tmp_path), "…")[:200])


@pytest.mark.fault(
    "Bad input: validate runs every check run runs",
    stage="spec",
    expect="the same model folders, unbroken (one file; an index with shards), validate with exit 0",
)
@pytest.mark.parametrize("which", ["single", "sharded"])
def test_whole_model_folders_validate(which, models, tmp_path, capsys, observe):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tmp_path / "runs", model={"name_or_path": str(models[which])})))
    code, err = _cli("validate", spec, capsys)
    assert code == 0, err
    observe(f"{which}: exit 0")
