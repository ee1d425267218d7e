"""Fixtures of the fault matrix, and the recorder that turns its results into tests/faults/results.json.

Every test here carries `@pytest.mark.fault(fault, stage=..., expect=...)`; the recorder writes one row per
test (fault, stage, what is expected, what was observed, the outcome) when the session ends, and
`render_reliability.py` renders the "Reliability" table of docs/reliability.md from that file, so the table is never
written by hand. The file is written only when SLIMTUNE_FAULTS_RESULTS names it: a test run never
changes the checkout, and refreshing the table is a deliberate command (see render_reliability.py).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from faultlib import run_finetune, spec_dict

_RESULTS = os.environ.get("SLIMTUNE_FAULTS_RESULTS")
_rows: list[dict] = []
_started = time.perf_counter()


def pytest_configure(config):
    config.addinivalue_line("markers", "fault(name, stage, expect): a row of the reliability table")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    mark = item.get_closest_marker("fault")
    if mark is None:
        return report
    # One row per test: the call phase decides, unless setup already failed or was skipped.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
            reason = report.wasxfail
        elif report.skipped:
            outcome = "skipped"
            reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        else:
            outcome = report.outcome if report.when == "call" else "error"
            reason = ""
            if not report.passed:
                crash = getattr(report.longrepr, "reprcrash", None)
                reason = (crash.message if crash else report.longreprtext).strip().splitlines()[0][:300]
        observed = "; ".join(v for k, v in item.user_properties if k == "observed")
        _rows.append(
            {
                "id": item.nodeid,
                "fault": mark.args[0],
                "stage": mark.kwargs.get("stage", "all"),
                "expect": mark.kwargs.get("expect", ""),
                "observed": observed,
                "outcome": outcome,
                "reason": reason,
                "seconds": round(report.duration, 2),
            }
        )
    return report


def pytest_sessionfinish(session, exitstatus):
    if not _rows or not _RESULTS:
        return
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    import torch

    body = {
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        "wall_s": round(time.perf_counter() - _started, 1),
        # children: the Prefect server, worker and flow-run processes, counted once they were waited for
        "cpu_s": round(sum(u.ru_utime + u.ru_stime for u in usage), 1),
        "tests": sorted(_rows, key=lambda r: r["id"]),
    }
    results = Path(_RESULTS)
    results.parent.mkdir(parents=True, exist_ok=True)
    tmp = results.with_name(f".{results.name}.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, results)


@pytest.fixture
def observe(request):
    """Record what the test saw (goes into the table's "observed" column)."""

    def _observe(text: str) -> None:
        request.node.user_properties.append(("observed", text))

    return _observe


@pytest.fixture(autouse=True)
def _empty_registry():
    """A failed test must not leave a live model for the next one."""
    yield
    from slimtune.core import registry

    registry.release_all()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, prefect_harness):
    """One clean run of the faults spec: what every faulted run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    summary = run_finetune(spec_dict(out))
    return {"run_dir": out / "faults", "summary": summary}


@pytest.fixture
def small_disk(tmp_path):
    """A factory for small tmpfs mounts: a real ENOSPC at a size chosen by the test (needs root/CAP_SYS_ADMIN)."""
    mounts: list[Path] = []

    def _mount(size_bytes: int) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        # tmpfs rounds the size up to whole pages
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill ({done.stderr.strip() or 'mount failed'}); run as root")
        mounts.append(where)
        return where

    yield _mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)
