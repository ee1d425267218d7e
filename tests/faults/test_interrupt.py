"""Ctrl-C and SIGTERM during `slimtune run`: out within seconds, no traceback, and the next run resumes.

The CLI runs as a real process in its own process group, and Ctrl-C is sent to the whole group the way a
terminal does (the temporary Prefect server is in that group too: it used to die first and leave the CLI
retrying against it for ~300 s). The bound on the exit (30 s) only catches a hang; the time is recorded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from faultlib import REPO, spec_dict
from prefect_server import seed_home

from slimtune.train.checkpoints import complete_checkpoints

_HANG_S = 30  # exit within GRACE_S (8 s) is the design; a hang took 305 s
_SPEC = {"train": {"max_steps": 400, "save_steps": 2}, "merge": {"enabled": False}, "export": {"gguf": []}}


def _start(tmp_path: Path) -> subprocess.Popen:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tmp_path / "runs", **_SPEC)))
    # a migrated database: the run's temporary server skips the migrations
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(seed_home(tmp_path / "prefect"))}
    # files, not pipes: nobody reads a pipe while the run goes, and a full one would block it
    proc = subprocess.Popen(
        [sys.executable, "-m", "slimtune.cli.main", "run", str(spec)],
        stdout=(tmp_path / "stdout").open("w"),
        stderr=(tmp_path / "stderr").open("w"),
        text=True,
        env=env,
        start_new_session=True,  # its own process group, like a terminal job
    )
    proc.stderr_path = tmp_path / "stderr"
    return proc


def _wait_for_checkpoint(proc: subprocess.Popen, root: Path, after: int) -> int:
    """Block until a complete checkpoint beyond step `after` exists; returns its step."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = complete_checkpoints(root)
        if done and int(done[-1].name.split("-")[1]) > after:
            return int(done[-1].name.split("-")[1])
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before a checkpoint: {_err(proc)[-2000:]}")
        time.sleep(0.5)
    pytest.fail("no checkpoint within 600 s")


def _signal(proc: subprocess.Popen, signals: list[int]) -> tuple[int, float, str]:
    """Send `signals` to the process group; returns (exit code, seconds to exit, stderr)."""
    start = time.monotonic()
    for sig in signals:
        os.killpg(proc.pid, sig)
        time.sleep(0.3)
    try:
        proc.wait(timeout=_HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running {_HANG_S} s after {signals}: {_err(proc)[-2000:]}")
    return proc.returncode, time.monotonic() - start, _err(proc)


def _err(proc: subprocess.Popen) -> str:
    return proc.stderr_path.read_text(errors="replace")


def _gone(pgid: int) -> bool:
    """True when no process of the group is left (the Prefect server included)."""
    for _ in range(50):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    return False


@pytest.mark.fault(
    "Interrupted (Ctrl-C, SIGTERM)",
    stage="packed_sft",
    expect="Ctrl-C: exit 130, SIGTERM: exit 143, each within 10 s, no traceback, nothing left running; "
    "the next run resumes from the last checkpoint",
)
def test_ctrl_c_then_sigterm_exit_fast_and_the_run_resumes(tmp_path, observe):
    root = tmp_path / "runs" / "faults" / "checkpoints"
    proc = _start(tmp_path)
    first = _wait_for_checkpoint(proc, root, 0)
    code, seconds, err = _signal(proc, [signal.SIGINT])
    assert _gone(proc.pid), "a process of the run (the Prefect server?) outlived it"
    assert code == 130, err[-2000:]
    assert "Traceback" not in err
    # one line from us (Prefect's own INFO lines about the run and its server may follow it)
    assert [line for line in err.splitlines() if line.startswith("slimtune: error: interrupted (SIGINT)")]
    kept = complete_checkpoints(root)[-1]
    observe(f"Ctrl-C at step ≥{first}: exit {code} after {seconds:.1f} s")

    proc = _start(tmp_path)
    resumed = _wait_for_checkpoint(proc, root, int(kept.name.split("-")[1]))
    code, seconds, err = _signal(proc, [signal.SIGTERM])
    assert _gone(proc.pid)
    assert code == 143, err[-2000:]
    assert "Traceback" not in err
    # resumed, not restarted: a restart would have moved the old checkpoints aside
    assert not root.with_name("checkpoints.previous").exists()
    observe(
        f"re-run resumed from {kept.name} (reached checkpoint-{resumed}); SIGTERM: exit {code} after {seconds:.1f} s"
    )


@pytest.mark.fault(
    "Interrupted (Ctrl-C, SIGTERM)",
    stage="packed_sft",
    expect="a second Ctrl-C forces the exit at once (130)",
)
def test_second_ctrl_c_forces_exit(tmp_path, observe):
    proc = _start(tmp_path)
    _wait_for_checkpoint(proc, tmp_path / "runs" / "faults" / "checkpoints", 0)
    code, seconds, err = _signal(proc, [signal.SIGINT, signal.SIGINT])
    assert _gone(proc.pid)
    assert code == 130, err[-2000:]
    assert "Traceback" not in err
    observe(f"two Ctrl-C: exit {code} after {seconds:.1f} s")
