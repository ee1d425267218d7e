"""The command line as a new user meets it: subcommands in workflow order, errors that name the flag given."""

from __future__ import annotations

import re

from slimtune.cli.main import main


def test_help_lists_the_subcommands_in_workflow_order(capsys):
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^    (\w+)\s", out, flags=re.MULTILINE)
    assert listed == ["init", "validate", "plan", "run", "deploy", "eval", "generate", "chat"], out
    assert "{init,validate,plan,run,deploy,eval,generate,chat}" in out


def test_eval_names_its_data_flag_when_the_file_is_missing(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--data", str(tmp_path / "held-out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"--data {tmp_path / 'held-out.jsonl'}: file not found" in err and "data.path" not in err, err
