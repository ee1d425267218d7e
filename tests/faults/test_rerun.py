"""Re-running a finished run, and who can read what a run wrote.

The re-run goes through `slimtune run` in a new process with another PYTHONHASHSEED: peft keeps
target_modules in a set, so before they were sorted every process wrote adapter_config.json in another
order and the merge's input hash never matched (merge reuse never happened through the CLI).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import yaml
from faultlib import REPO, spec_dict
from prefect_server import seed_home

from slimtune.core.atomic import umask


@pytest.mark.fault(
    "Re-run of a finished run",
    stage="dequant_merge",
    expect="a re-run in another process reuses the merge and keeps the model card's training time",
)
def test_rerun_reuses_the_merge_and_keeps_the_training_time(reference_run, tmp_path, observe):
    out = tmp_path / "out"
    shutil.copytree(reference_run["run_dir"], out / "faults")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(out)))
    home = seed_home(tmp_path / "prefect")  # a migrated database: the temporary server skips the migrations
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(home), "PYTHONHASHSEED": "7"}
    done = subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", "run", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "faults" / "report.json").read_text())
    first = reference_run["summary"]
    assert report["packed_sft"]["steps"] == first["packed_sft"]["steps"]
    assert report["dequant_merge"]["reused"], "the merge ran again"
    card = (out / "faults" / "gguf" / "README.md").read_text()
    reference_card = (reference_run["run_dir"] / "gguf" / "README.md").read_text()
    assert card == reference_card, "the model card changed (training time?)"
    observe(
        f"merge reused: {report['dequant_merge']['reused']}; training time "
        f"{first['packed_sft']['training_seconds']:.2f} s kept (re-run call {report['packed_sft']['seconds']:.2f} s)"
    )


@pytest.mark.fault(
    "Outputs others cannot read",
    stage="all",
    expect="every published file and folder gets its mode from the umask (no 0600 GGUF or adapter, no 0700 merged/)",
)
def test_published_outputs_follow_the_umask(reference_run, observe):
    run_dir = reference_run["run_dir"]
    mask = umask()
    wrong = []
    for path in sorted(run_dir.rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(run_dir).parts):
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        want = (0o777 if path.is_dir() else 0o666) & ~mask
        if mode & 0o077 != want & 0o077:  # what others see (the owner bits may carry x for executables)
            wrong.append(f"{path.relative_to(run_dir)} {oct(mode)}")
    observe(f"umask {oct(mask)}: " + (", ".join(wrong[:5]) if wrong else "all files and folders match"))
    assert not wrong
