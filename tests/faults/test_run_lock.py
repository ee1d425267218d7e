"""Two runs with one run directory: the second stops at once, naming the directory and the holder's PID.

Also when the run directory was deleted under the first run: the lock lives outside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml
from faultlib import REPO, spec_dict

from slimtune.cli.main import EXIT_INVALID_SPEC, main
from slimtune.flows.run_lock import lock_path, run_lock

_HOLD = """import sys, time
from slimtune.flows.run_lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the run directory of the faults spec under tmp_path."""
    run_dir = tmp_path / "runs" / "faults"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc, run_dir
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.fault(
    "Two runs, one run directory",
    stage="all",
    expect="the second run exits 2 before loading anything, with one line naming the run dir and the holder's PID",
)
def test_second_run_with_the_same_run_dir_exits_at_once(holder, tmp_path, capsys, observe):
    proc, run_dir = holder
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tmp_path / "runs")))
    loaded = "slimtune.flows.finetune" in sys.modules
    code = main(["run", str(spec)])
    err = capsys.readouterr().err.strip()
    observe(err.replace(str(tmp_path), "…"))
    assert code == EXIT_INVALID_SPEC
    assert len(err.splitlines()) == 1 and str(run_dir) in err and f"PID {proc.pid}" in err
    if not loaded:  # no model stage was even imported
        assert "slimtune.flows.finetune" not in sys.modules
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.fault(
    "Two runs, one run directory",
    stage="all",
    expect="a lock left by a dead run (SIGKILL) is taken over; the lock file is gone after the run",
)
def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path, observe):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = lock_path(run_dir)
    lock.parent.mkdir(parents=True, exist_ok=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(dead.stdout)
    with run_lock(run_dir):
        assert lock.read_text().splitlines()[0] == str(os.getpid())
        with run_lock(run_dir):  # the CLI and the flow it runs take it in one process
            pass
        assert lock.exists()
    assert not lock.exists()
    observe(f"lock of dead PID {dead.stdout.strip()} taken over; removed at the end")


@pytest.mark.fault(
    "Two runs, one run directory",
    stage="all",
    expect="the run directory deleted under a live run: a second run of the same name still exits 2 naming the holder",
)
def test_second_run_after_the_run_dir_was_deleted_exits_at_once(holder, tmp_path, capsys, observe):
    proc, run_dir = holder
    shutil.rmtree(run_dir)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tmp_path / "runs")))
    code = main(["run", str(spec)])
    err = capsys.readouterr().err.strip()
    observe(err.replace(str(tmp_path), "…"))
    assert code == EXIT_INVALID_SPEC, err
    assert len(err.splitlines()) == 1 and str(run_dir) in err and f"PID {proc.pid}" in err
    assert not (run_dir / "checkpoints").exists()
