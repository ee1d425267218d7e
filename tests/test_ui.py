"""The Prefect UI shows a finished run: six named task runs, the memory report and the run report as tables.

Headless Chromium (Debian's `chromium`; .ci/run installs it) loads the UI served by a real
`prefect server start`, after the tiny pipeline ran against that server. The UI is a JavaScript app,
so the checks read the DOM Chromium rendered, not the HTML the server sent. The screenshot of the
flow-run page is kept in the run directory (runs/tiny-smoke-ui/ui-flow-run.png) as the CI artifact.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from prefect_server import REPO, start_server

from slimtune.flows.stages import STAGES

_CHROMIUM = Path("/usr/bin/chromium")
_NAME = "tiny-smoke-ui"
# Virtual time lets the app fetch and render before the DOM is dumped; 15 s covers the slowest page here.
_BUDGET_MS = 15000


class _Tables(HTMLParser):
    """The text of every table cell in a rendered page, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th") and self.rows:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _rendered(profile: Path, url: str, needle: str) -> str:
    """The page's DOM once `needle` is in it: the app renders from API calls, which take longer on a busy
    machine (seen: an empty page after 15 s of virtual time while the whole suite ran on 2 cores)."""
    dom = ""
    for budget_ms in (_BUDGET_MS, 2 * _BUDGET_MS, 4 * _BUDGET_MS):
        dom = _chromium(profile, url, "--dump-dom", budget_ms=budget_ms)
        if needle in dom:
            break
    return dom


def _chromium(profile: Path, url: str, *args: str, budget_ms: int = _BUDGET_MS) -> str:
    if not _CHROMIUM.is_file():
        pytest.fail("Chromium is missing: apt-get install -y chromium (.ci/run installs it before the tests)")
    cmd = [
        str(_CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        "--window-size=1400,1000",
        *args,
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def _table_rows(html: str) -> list[list[str]]:
    parser = _Tables()
    parser.feed(html)
    return [row for row in parser.rows if row]


def test_flow_run_page_shows_tasks_and_reports(tmp_path, request):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from slimtune.spec import load_spec

    server = start_server(tmp_path / "home", request.addfinalizer, ui=True)
    spec = load_spec(REPO / "deployments" / "tiny-smoke.yaml")
    spec.name = _NAME
    shutil.rmtree(spec.run_dir(), ignore_errors=True)  # a fresh run, not a resumed one
    # The flow runs in its own process: Prefect 3 reports task runs as events through a process-wide
    # worker bound to the first API it saw, which inside this test session may be another test's server.
    run_flow = (
        "import sys; from slimtune.flows import finetune; from slimtune.spec import load_spec; "
        "s = load_spec(sys.argv[1]); s.name = sys.argv[2]; finetune(s)"
    )
    done = subprocess.run(
        [sys.executable, "-c", run_flow, str(REPO / "deployments" / "tiny-smoke.yaml"), _NAME],
        env=server.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with temporary_settings({PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            (run,) = client.read_flow_runs()
            artifacts = {a.key: a.id for a in client.read_artifacts() if a.flow_run_id == run.id}

    assert {"memory-report", "run-report", f"{_NAME}-training"} <= set(artifacts), artifacts
    root = server.url.removesuffix("/api")
    profile = tmp_path / "chromium"
    tasks_dom = _rendered(profile, f"{root}/runs/flow-run/{run.id}?tab=Task%20Runs", f"{STAGES[-1]} [{_NAME}]")
    for stage in STAGES:
        assert f"{stage} [{_NAME}]" in tasks_dom, f"task run {stage} not rendered"
    assert f"{_NAME}: builtin:tiny-llama on tiny_chat.jsonl" in tasks_dom  # the flow run's name

    memory = _table_rows(_rendered(profile, f"{root}/artifacts/artifact/{artifacts['memory-report']}", STAGES[-1]))
    assert memory and memory[0][:2] == ["stage", "outcome"], memory[:2]
    assert [row[0] for row in memory[1:]] == list(STAGES)  # one rendered row per stage, in pipeline order
    assert all(row[1] == "completed" for row in memory[1:]), memory

    report = _table_rows(_rendered(profile, f"{root}/artifacts/artifact/{artifacts['run-report']}", "steps"))
    assert ["steps", "4"] in report, report  # the packed_sft table of the run report

    shot = spec.run_dir() / "ui-flow-run.png"
    _chromium(profile, f"{root}/runs/flow-run/{run.id}", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
