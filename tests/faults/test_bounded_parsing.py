"""Hostile files: alias bombs, deep nesting and huge values are refused in bounded time and memory, in one line.

A 700-byte YAML alias bomb took 388 s and 3.1 GB to reject (the spec validator formatted the expanded value
into its message); deeply nested JSON data raised a RecursionError traceback. The bombs here go through
a subprocess with a memory cap and a timeout, so that the code before the fix fails the test instead of
taking the machine down.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest
import yaml
from faultlib import REPO, spec_dict

from slimtune.cli.main import EXIT_INVALID_SPEC

_LEVELS = "abcdefghi"  # 9 levels of 10: 10**9 strings once expanded


def _bomb_yaml() -> str:
    """The classic "billion laughs", aimed at a list field (lora.target_modules) the validator reports on."""
    lines = [f"{_LEVELS[0]}: &{_LEVELS[0]} [{', '.join(['lol'] * 10)}]"]
    for prev, name in zip(_LEVELS, _LEVELS[1:], strict=False):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    return "\n".join(lines) + "\n"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`slimtune ARGS` in a subprocess capped at 6 GiB of address space (a bomb's expansion fails there instead
    of swapping the machine) and at `timeout` seconds."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        return subprocess.run(
            [sys.executable, "-m", "slimtune.cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            preexec_fn=cap,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"slimtune {' '.join(args)} did not finish within {timeout} s")


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.fault(
    "Hostile input: YAML alias bomb",
    stage="spec",
    expect="refused before expansion: exit 2 in well under a second, one problem line naming the file",
)
def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, observe):
    data = spec_dict(tmp_path / "runs")
    spec = tmp_path / "bomb.yaml"
    text = yaml.safe_dump(data) + _bomb_yaml() + "lora: {r: 8, alpha: 16, target_modules: *i}\n"
    spec.write_text(text.replace("lora:\n  alpha: 16\n  gradient_checkpointing: false\n  r: 8\n", ""))
    assert len(_bomb_yaml()) < 700
    done = _cli("validate", str(spec))
    assert done.returncode == EXIT_INVALID_SPEC, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    problems = [line for line in _errors(done.stderr) if line.strip().startswith("- ")]
    assert len(problems) == 1 and "bomb.yaml" in problems[0] and "aliases" in problems[0], done.stderr
    assert len(done.stderr) < 1000, done.stderr[:2000]
    observe(problems[0].strip())

    from slimtune.spec.schema import SpecError, load_spec

    started = time.perf_counter()
    with pytest.raises(SpecError):
        load_spec(spec)
    seconds = time.perf_counter() - started
    observe(f"load_spec refused it in {seconds * 1000:.0f} ms")
    assert seconds < 0.5


@pytest.mark.fault(
    "Hostile input: YAML alias bomb",
    stage="spec",
    expect="an alias bomb in a --set value is refused before expansion, exit 2",
)
def test_yaml_alias_bomb_in_an_override(tmp_path, observe):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tmp_path / "runs")))
    value = "{" + ", ".join(_bomb_yaml().splitlines()) + "}"  # the same bomb as one flow mapping
    done = _cli("validate", str(spec), "--set", f"lora.target_modules={value}")
    assert done.returncode == EXIT_INVALID_SPEC, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr) < 1500, done.stderr[-2000:]
    line = next(line for line in _errors(done.stderr) if "--set" in line)
    assert "aliases" in line, line
    observe(line.strip()[:200])


def test_alias_cycle_and_depth_are_refused(tmp_path):
    from slimtune.spec.schema import SpecError, load_spec

    spec = tmp_path / "cycle.yaml"
    spec.write_text("lora: &a {r: *a}\n")
    with pytest.raises(SpecError, match="cycle.yaml: the alias at line 1"):
        load_spec(spec)
    spec.write_text("lora: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(SpecError, match="nests deeper than 64 levels"):
        load_spec(spec)


def test_ordinary_aliases_and_merge_keys_still_load(tmp_path):
    from slimtune.spec.schema import load_spec

    data = spec_dict(tmp_path / "runs")
    del data["lora"], data["train"]
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(data)
        + "lora: &lora {r: &eight 8, alpha: 16, gradient_checkpointing: false}\n"
        + "train: {micro_batch_size: *eight, max_steps: 3, <<: {seed: 5}}\n"
    )
    spec_ = load_spec(spec)
    assert (spec_.train.micro_batch_size, spec_.train.seed, spec_.lora.r) == (8, 5, 8)


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


_GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("levels", [100, 100_000], ids=["100 levels", "100k levels"])
@pytest.mark.fault(
    "Hostile input: deeply nested JSON data",
    stage="data",
    expect="a record nested past 64 levels is a bad record at file:line (skipped or refused), never a traceback",
)
def test_deeply_nested_json_record(tmp_path, levels, observe):
    from slimtune.data.records import iter_records

    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text(json.dumps(_GOOD) + "\n" + '{"messages": ' + _deep(levels) + "}\n")
    records = list(iter_records(str(jsonl)))
    assert records[0].problem is None and records[0].value == _GOOD
    assert records[1].where == f"{jsonl}:2" and "nested deeper than 64 levels" in (records[1].problem or ""), records
    observe(f"{records[1].where.replace(str(tmp_path), '…')}: {records[1].problem}")

    array = tmp_path / "deep.json"
    array.write_text("[\n" + json.dumps(_GOOD) + ",\n" + '{"messages": ' + _deep(levels) + "}\n]\n")
    from slimtune.data import DataError

    try:
        records = list(iter_records(str(array)))
    except DataError as e:  # past the parser's own limit the list cannot be split further: refused at its line
        assert f"{array}:3" in str(e) and "nested deeper than 64 levels" in str(e), e
    else:
        assert "nested deeper than 64 levels" in (records[1].problem or ""), records


def test_deeply_nested_config_json_names_the_file(tmp_path):
    from slimtune.models.source import ModelSourceError, read_model_json

    config = tmp_path / "config.json"
    config.write_text('{"a": ' + _deep(100_000) + "}")
    with pytest.raises(ModelSourceError, match="config.json is not valid JSON .*nested deeper than 64 levels"):
        read_model_json(config)


@pytest.mark.fault(
    "Hostile input: BOM before a JSON array",
    stage="data",
    expect="a UTF-8 BOM (Windows editors) before the data is ignored; the records are read",
)
def test_bom_before_json_data(tmp_path):
    from slimtune.data.records import iter_records

    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps([_GOOD, _GOOD]).encode())
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + (json.dumps(_GOOD) + "\n").encode() * 2)
    for path in (array, jsonl):
        records = list(iter_records(str(path)))
        assert [r.problem for r in records] == [None, None] and records[0].value == _GOOD, records


@pytest.mark.fault(
    "Hostile input: huge values in a spec",
    stage="spec",
    expect="errors quote at most a clipped view of a value (a 1 MB path, a 5,000-item list, a 100 kB number)",
)
def test_messages_never_quote_unbounded_input(tmp_path, capsys, observe):
    from slimtune.cli.main import main

    data = spec_dict(tmp_path / "runs")
    data["data"]["path"] = "/nowhere/" + "x" * 1_000_000 + ".jsonl"
    data["lora"]["target_modules"] = [[i] for i in range(5_000)]
    data["train"]["seed"] = "9" * 100_000
    spec = tmp_path / "huge.yaml"
    spec.write_text(yaml.safe_dump(data))
    for extra in ([], ["--set", "lora.nope" + "y" * 100_000 + "=1"]):
        code = main(["validate", str(spec), *extra])
        err = capsys.readouterr().err
        assert code == EXIT_INVALID_SPEC, err[-2000:]
        assert len(err) < 6000, f"{len(err)} characters of error for a {spec.stat().st_size}-byte spec"
        observe(
            f"{len(err):,} characters of error for a {spec.stat().st_size:,}-byte spec{' and --set' if extra else ''}"
        )
