"""Hub failures during gguf_convert_and_push, against the local fake Hub (tests/hub_server.py).

5xx then success is retried with backoff; 401/403/404 fail at the first attempt; the token never appears in
logs, in the task's result, or in any file of the run directory.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest
from faultlib import spec_dict

from slimtune.export import PushError
from slimtune.spec.schema import parse_spec
from slimtune.tasks.gguf_convert_and_push import gguf_convert_and_push

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hub_server import FakeHub

TOKEN = "hf_faultmatrixSECRET0123456789"
_REPO = "org/faults"


@pytest.fixture
def hub(monkeypatch):
    with FakeHub(token=TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the fake Hub is local; offline mode refuses it
        from huggingface_hub import constants as hf_constants

        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # frozen at import from the env above
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)  # likewise: plain LFS, which the fake Hub speaks
        yield server


def _push(reference_run, tmp_path):
    spec = parse_spec(spec_dict(tmp_path, export={"gguf": ["f16"], "verify": False, "push": {"repo_id": _REPO}}))
    run = reference_run["run_dir"]
    summary = {"spec": spec.model_dump(mode="json"), "train": {"steps": 4}}
    return spec, gguf_convert_and_push(spec, run / "merged", run / "adapter", summary)


def _token_leaks(caplog, tmp_path, *texts: str) -> list[str]:
    where = [f"log: {r.getMessage()[:80]}" for r in caplog.records if TOKEN in r.getMessage()]
    where += [f"text: {t[:80]}" for t in texts if TOKEN in t]
    where += [str(p) for p in tmp_path.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    return where


@pytest.mark.fault(
    "Hub failure: 5xx then success",
    stage="gguf_convert_and_push",
    expect="retried after a backoff; one commit with the GGUF; token in no log, result or file",
)
def test_5xx_then_success(hub, reference_run, tmp_path, caplog, observe):
    hub.fail_next(r"/commit/main$", 503, times=1, body="busy, retry later ({authorization})")
    caplog.set_level(logging.DEBUG)
    started = time.monotonic()
    spec, result = _push(reference_run, tmp_path)
    elapsed = time.monotonic() - started
    pushed = result.pushed
    observe(f"attempts {pushed['attempts']}, {elapsed:.1f} s; files {sorted(hub.files(_REPO))}")
    assert pushed["attempts"] == 2
    assert elapsed >= 1.0  # push_folder's first backoff is 1 s
    assert "faults-f16.gguf" in hub.files(_REPO)
    # the Hub's own initial commit (.gitattributes), then exactly one of ours: the failed try left nothing
    assert [c.summary for c in hub.commits(_REPO)] == ["initial commit", f"slimtune: {spec.name}"]
    assert _token_leaks(caplog, tmp_path, json.dumps(result.to_dict())) == []


@pytest.mark.parametrize(
    "status,path", [(401, None), (403, r"^/api/repos/create$"), (404, r"/commit/main$")], ids=["401", "403", "404"]
)
@pytest.mark.fault(
    "Hub failure: 401/403/404",
    stage="gguf_convert_and_push",
    expect="PushError at the first attempt with what to do; token in no log, message or file",
)
def test_client_errors_fail_at_once(hub, reference_run, tmp_path, caplog, monkeypatch, observe, status, path):
    if status == 401:
        hub.token = "hf_the_right_one"  # ours is now wrong: the Hub answers 401
    else:
        hub.fail_next(path, status, times=5, body=f"denied for {{authorization}} ({status})")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PushError) as err:
        _push(reference_run, tmp_path)
    message = str(err.value)
    observe(f"PushError status {err.value.status} after {err.value.attempts} attempt(s): {message[:100]}")
    assert err.value.status == status and err.value.attempts == 1
    assert _token_leaks(caplog, tmp_path, message) == []
