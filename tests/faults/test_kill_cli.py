"""SIGKILL of `slimtune run` mid-training, then the same command again on the same machine.

Without a Prefect server (`slimtune run` starts a temporary one) the GPU slot used to be a lease in that
server's memory, which nothing revokes: after a kill the next run on the machine waited for the slot
forever (seen on a GPU and here: over 5 minutes, until killed). The slot is now a lock file the kernel
frees with its holder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultlib import REPO, spec_dict
from prefect_server import seed_home

_START_TIMEOUT_S = 240
_RUN_TIMEOUT_S = 300


def _start(spec: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "slimtune.cli.main", "run", str(spec)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its temporary server joins this group, to be cleaned up after
        )


@pytest.mark.fault(
    "SIGKILL of `slimtune run` (no Prefect server), then a re-run",
    stage="packed_sft",
    expect="the re-run does not wait for the dead run's GPU slot, resumes and completes",
)
def test_a_rerun_after_sigkill_gets_the_gpu_slot(tmp_path, observe):
    spec = tmp_path / "spec.json"
    # Enough steps that the first run is still training when the kill comes (it comes within 0.5 s of "step 3/";
    # steps 4-12 with their checkpoints, then merge and GGUF, take over 10 s), and few enough that the re-run
    # finishes soon: with 40 steps it trained 51 s of its 88 s after resuming (2 loaded cores).
    spec.write_text(json.dumps(spec_dict(tmp_path / "out", train={"max_steps": 12, "save_steps": 2})))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    # seeded with a migrated database: the first run's temporary server skips the migrations
    env.update(PREFECT_HOME=str(seed_home(tmp_path / "prefect-home")), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = _start(spec, first_log, env)
    second = None
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while "step 3/" not in first_log.read_text() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert first.poll() is None, first_log.read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)  # the CLI process only, as the OOM killer would
        first.wait(timeout=30)
        second = _start(spec, second_log, env)
        rc = second.wait(timeout=_RUN_TIMEOUT_S)
        text = second_log.read_text()
        observe(f"re-run exit {rc}; waited for the slot: {'waiting for the GPU' in text}")
        assert rc == 0, text[-3000:]
        assert "waiting for the GPU" not in text
        report = json.loads((tmp_path / "out" / "faults" / "train_report.json").read_text())
        assert report["resumed_from"] and "checkpoint-" in report["resumed_from"], report
        assert (tmp_path / "out" / "faults" / "adapter" / "adapter_model.safetensors").is_file()
    finally:
        for proc in (first, second):
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
