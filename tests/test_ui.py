"""The Prefect UI shows a run as a user needs it: progress with loss and ETA while it trains; afterwards the
loss curve, the memory chart and the GGUF verification, listed on the flow-run page and shown on their
artifact pages (Prefect 3.8 lists artifacts on the run page as cards); and a run form without broken fields.

Headless Chromium (Debian's `chromium`; .ci/run installs it) loads the UI served by a real
`prefect server start`. The UI is a JavaScript app, so the checks read the DOM Chromium rendered, not
the HTML the server sent, and a picture counts as shown only when its colours are in the screenshot.
Everything (run directory, Prefect home, screenshots) is written under pytest's tmp folder; the
screenshots' folder is printed (`pytest -s`) and kept by pytest as the test's output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from cdp import HEADLESS_FLAGS
from prefect_server import REPO, start_server

from slimtune.spec.schema import STAGES

_CHROMIUM = Path("/usr/bin/chromium")
_NAME = "tiny-smoke-ui"
_STEPS = 24  # 1-5 s a step on 2 busy CPU cores: long enough to see the progress artifact mid-training
# Virtual time lets the app fetch and render before the DOM is dumped; 15 s covers the slowest page here.
_BUDGET_MS = 15000
_TAB_BLUE = (31, 119, 180)  # matplotlib's first colour: the train-loss line and the host-memory bars


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


def _chromium(profile: Path, url: str, *args: str, budget_ms: int = _BUDGET_MS, height: int = 1000) -> str:
    if not _CHROMIUM.is_file():
        pytest.fail("Chromium is missing: apt-get install -y chromium (.ci/run installs it before the tests)")
    cmd = [
        str(_CHROMIUM),
        *HEADLESS_FLAGS,
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        f"--window-size=1400,{height}",
        *args,
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def _screenshot(profile: Path, url: str, shot: Path, height: int = 1000) -> Path:
    _chromium(profile, url, f"--screenshot={shot}", height=height)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot
    print(f"screenshot: {shot}")
    return shot


def _pixels_near(shot: Path, colour: tuple[int, int, int], tolerance: int = 20) -> int:
    """How many pixels of the screenshot are within `tolerance` of `colour` in every channel."""
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    return sum(all(abs(a - b) <= tolerance for a, b in zip(px, colour)) for px in image.getdata())


def _table_rows(html: str) -> list[list[str]]:
    parser = _Tables()
    parser.feed(html)
    return [row for row in parser.rows if row]


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    return start_server(tmp_path_factory.mktemp("prefect-home"), request.addfinalizer, ui=True)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ui-screenshots")
    print(f"UI screenshots are kept in {folder}")
    return folder


def _spec_file(tmp_path: Path) -> Path:
    """tiny-smoke, longer, with its run directory under tmp_path (never inside the checkout)."""
    from slimtune.spec.schema import load_spec

    spec = load_spec(REPO / "deployments" / "tiny-smoke.yaml")
    spec.name, spec.output_dir = _NAME, str(tmp_path / "runs")
    spec.train.max_steps, spec.train.save_steps, spec.train.logging_steps = _STEPS, _STEPS, 1
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return path


def _artifacts(server, run_id=None) -> list:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            return [a for a in client.read_artifacts() if run_id is None or a.flow_run_id == run_id]


def test_flow_run_page_shows_progress_charts_and_gguf_verification(server, shots, tmp_path):
    root = server.url.removesuffix("/api")
    profile = tmp_path / "chromium"
    # The flow runs in its own process: Prefect 3 reports task runs as events through a process-wide
    # worker bound to the first API it saw, which inside this test session may be another test's server.
    run_flow = (
        "import sys; from slimtune.flows.finetune import finetune; from slimtune.spec.schema import load_spec; "
        "finetune(load_spec(sys.argv[1]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", run_flow, str(_spec_file(tmp_path))],
        env=server.env,
        cwd=tmp_path,
        stdout=(tmp_path / "flow.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        # During training: the progress artifact has a loss and an ETA, rendered by the UI.
        progress = None
        deadline = time.monotonic() + 400
        while progress is None and proc.poll() is None and time.monotonic() < deadline:
            found = [
                a
                for a in _artifacts(server)
                if a.key == f"{_NAME}-progress" and {"ETA", "loss"} <= set((a.description or "").split())
            ]
            progress = found[0] if found and found[0].data < 100 else None
            time.sleep(0.5)
        assert progress is not None, (tmp_path / "flow.log").read_text()[-3000:]
        dom = _rendered(profile, f"{root}/artifacts/artifact/{progress.id}", "ETA")
        shown = re.search(
            r"stage 3 of 6: packed_sft(?:\s*<[^>]+>)+\s*step (\d+)/(\d+) · ETA [\dhms ]+(?:\s*<[^>]+>)+\s*"
            r"loss \d+\.\d{4} · [\d,]+ tok/s",  # one paragraph (element) per line
            dom,
        )
        assert shown, re.findall(r"stage \d of 6.{0,300}", dom) or dom[-3000:]
        assert 100 / 3 <= progress.data < 50  # training fills stage 3's share of the run's bar
        assert int(shown.group(1)) < int(shown.group(2)) == _STEPS  # caught while training, not after
        _screenshot(profile, f"{root}/artifacts/artifact/{progress.id}", shots / "during-training-progress.png")
        assert proc.wait(timeout=900) == 0, (tmp_path / "flow.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (REPO / "runs" / _NAME).exists()  # the run stayed under tmp_path
    flow_log = (tmp_path / "flow.log").read_text()
    starts = [flow_log.find(f"stage {k} of {len(STAGES)}: {stage}: ") for k, stage in enumerate(STAGES, 1)]
    assert -1 not in starts and starts == sorted(starts), starts  # a start line per stage, in order

    (run_id,) = {a.flow_run_id for a in _artifacts(server) if a.key == "run-report"}
    artifacts = _artifacts(server, run_id)
    latest = {a.key: a for a in sorted(artifacts, key=lambda a: a.created)}
    # One artifact per kind, updated in place (the charts were re-drawn many times: once per eval and stage)
    keyed = [f"{_NAME}-{kind}" for kind in ("progress", "loss-curve", "memory-chart")] + ["run-report"]
    assert [sum(a.key == key for a in artifacts) for key in keyed] == [1, 1, 1, 1], sorted(a.key for a in artifacts)
    assert latest[f"{_NAME}-progress"].data == 100.0 and "finished in" in latest[f"{_NAME}-progress"].description

    # After the run: the flow-run page lists every stage and shows the pictures and the GGUF verification.
    page = f"{root}/runs/flow-run/{run_id}"
    tasks_dom = _rendered(profile, f"{page}?tab=Task%20Runs", f"{STAGES[-1]} [{_NAME}]")
    for stage in STAGES:
        assert f"{stage} [{_NAME}]" in tasks_dom, f"task run {stage} not rendered"

    for key, shot in ((f"{_NAME}-loss-curve", "loss-curve.png"), (f"{_NAME}-memory-chart", "memory-chart.png")):
        url = f"{root}/artifacts/artifact/{latest[key].id}"
        dom = _rendered(profile, url, "data:image/png;base64,")
        assert re.search(r'<img [^>]*src="data:image/png;base64,', dom), f"{key}: no image in the page"
        blue = _pixels_near(_screenshot(profile, url, shots / shot), _TAB_BLUE)
        assert blue > 300, f"{key}: the picture is in the DOM but not on screen ({blue} matplotlib-blue pixels)"

    report = _table_rows(_rendered(profile, f"{root}/artifacts/artifact/{latest['run-report'].id}", ".gguf"))
    gguf = [row for row in report if row and row[0] == f"{_NAME}-f16.gguf"]
    assert gguf and gguf[0][2].endswith("%") and float(gguf[0][2][:-1]) > 90, report
    _screenshot(profile, f"{root}/artifacts/artifact/{latest['run-report'].id}", shots / "run-report.png", 1600)
    # The flow-run page lists the artifacts (cards linking to the pages above); the V1 UI resets a ?tab= link
    # to Logs while the run loads, the V2 UI keeps it. Its Logs tab has the step lines.
    listing_url = f"{root}/v2/runs/flow-run/{run_id}?tab=Artifacts"
    listing = _rendered(profile, listing_url, "memory-chart")
    for key in ("run-report", "memory-report", *keyed):
        assert listing.count(f">{key}<") == 1, f"{key} is listed {listing.count(f'>{key}<')} times on the flow-run page"
    assert "finished in" in listing  # the progress card's text
    _screenshot(profile, listing_url, shots / "flow-run-artifacts.png", 1400)
    _screenshot(profile, page, shots / "flow-run-logs.png", 2400)

    memory = _table_rows(_rendered(profile, f"{root}/artifacts/artifact/{latest['memory-report'].id}", STAGES[-1]))
    assert memory and memory[0][:2] == ["stage", "outcome"], memory[:2]
    assert [row[0] for row in memory[1:]] == list(STAGES)  # one rendered row per stage, in pipeline order
    assert all(row[1] == "completed" for row in memory[1:]), memory


def test_run_form_renders_every_field(server, shots, tmp_path):
    register = (
        "import json, sys; from slimtune.flows.finetune import finetune; "
        "print(finetune.to_deployment(name='form', parameters={'spec': json.loads(sys.argv[1])}).apply())"
    )
    params = {"name": "form", "model": {"name_or_path": "builtin:tiny-llama", "device": "cpu"}}
    done = subprocess.run(
        [sys.executable, "-c", register, json.dumps(params)],
        env=server.env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    deployment_id = done.stdout.strip().splitlines()[-1]
    url = f"{server.url.removesuffix('/api')}/deployments/deployment/{deployment_id}/run"
    profile = tmp_path / "chromium"
    dom = _rendered(profile, url, "Target Modules")
    _screenshot(profile, url, shots / "run-form.png", 4000)
    for label in ("Target Modules", "Max Steps", "Report To", "Gradient Checkpointing", "License"):
        assert label in dom, f"{label} is not on the form"
    assert "is a const" not in dom and "is not of type" not in dom
    assert dom.count("Property is type") == 2  # only the optional sections' "Off" choices: Push, the Ray cluster
    assert "builtin:tiny-llama, builtin:tiny-mistral" in dom  # help text with its names intact
