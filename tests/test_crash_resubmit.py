"""A flow run SIGKILLed like the host OOM killer would is re-submitted, downshifted, by its on_crashed hook.

Runs a real `prefect server`, a process work pool and a `prefect worker` as subprocesses: the hook
only runs in the worker that launched the killed process, so nothing in-process can stand in.
"""

from __future__ import annotations

import time
from pathlib import Path

import prefect.deployments
import pytest
from crash_flow import crash_once, halve_micro_batch
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings
from prefect.states import Crashed
from prefect.workers.process import ProcessWorker
from prefect_server import start_server, start_worker

from slimtune.flows.resubmit import resubmit_on_crash

_TESTS = Path(__file__).resolve().parent
_POOL = "crash-pool"


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    return start_server(tmp_path_factory.mktemp("prefect-home"), request.addfinalizer)


def test_killed_flow_run_is_resubmitted_downshifted(server, request):
    with temporary_settings({PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            client.create_work_pool(
                WorkPoolCreate(
                    name=_POOL,
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                )
            )
        deployment_id = crash_once.from_source(source=str(_TESTS), entrypoint="crash_flow.py:crash_once").deploy(
            name="crash", work_pool_name=_POOL, print_next_steps=False
        )
        worker = start_worker(server, _POOL, request.addfinalizer)

        spec = {"train": {"micro_batch_size": 8, "gradient_accumulation_steps": 2}}
        with get_client(sync_client=True) as client:
            first = client.create_flow_run_from_deployment(deployment_id, parameters={"spec": spec})
            deadline = time.monotonic() + 150
            runs = []
            while time.monotonic() < deadline:
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                    flow_run_filter=FlowRunFilter(),
                )
                later = [r for r in runs if r.id != first.id]
                if later and later[0].state and later[0].state.is_final():
                    break
                if worker.poll() is not None:
                    break
                time.sleep(1)
            log = server.log("worker.log")
            first_run = client.read_flow_run(first.id)

    assert first_run.state.is_crashed(), f"{first_run.state}\n{log}"
    later = [r for r in runs if r.id != first.id]
    assert len(later) == 1, f"expected one re-submission, got {len(later)}\n{log}"
    second = later[0]
    assert second.state.is_completed(), f"{second.state}\n{log}"
    assert second.parameters["spec"]["train"] == {"micro_batch_size": 4, "gradient_accumulation_steps": 4}
    assert second.parameters["spec"]["resubmits"] == 1 and second.parameters["spec"]["resume"] is True
    assert "resubmit-1" in second.tags


def _crashed_run(tags: list[str], deployment: bool = True):
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun

    return FlowRun(
        name="oom-victim",
        flow_id=uuid4(),
        deployment_id=uuid4() if deployment else None,
        parameters={"spec": {"train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1}}},
        tags=tags,
    )


@pytest.mark.parametrize(
    "tags,message,deployment,expect_tag",
    [
        (["nightly"], "Process exited with status code: -9. SIGKILL", True, "resubmit-1"),
        (["nightly", "resubmit-1"], "Process exited with status code: 137.", True, "resubmit-2"),
        (["resubmit-2"], "Process exited with status code: -9.", True, None),  # the bound is reached
        ([], "Process exited with status code: 1.", True, None),  # crashed, but not killed
        ([], "Process exited with status code: -9.", False, None),  # no deployment to re-submit
    ],
)
def test_hook_decisions(monkeypatch, tags, message, deployment, expect_tag):
    """The hook's bound, signal and deployment checks, without a server (run_deployment recorded)."""
    submitted = []

    def fake_run_deployment(**kwargs):
        submitted.append(kwargs)
        return _crashed_run(kwargs["tags"])

    monkeypatch.setattr(prefect.deployments, "run_deployment", fake_run_deployment)
    run = _crashed_run(tags, deployment)
    # No server here: keep the hook's flow-run log lines local.
    with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
        resubmit_on_crash(halve_micro_batch, max_resubmits=2)(crash_once, run, Crashed(message=message))
    if expect_tag is None:
        assert submitted == []
        return
    (call,) = submitted
    assert call["name"] == run.deployment_id and call["timeout"] == 0
    assert call["tags"] == ["nightly", expect_tag]
    assert call["parameters"]["spec"]["train"] == {"micro_batch_size": 1, "gradient_accumulation_steps": 2}
    assert call["idempotency_key"] == f"{run.id}-resubmit"


def test_hook_stops_when_the_downshift_has_nothing_left(monkeypatch):
    submitted = []
    monkeypatch.setattr(prefect.deployments, "run_deployment", lambda **kw: submitted.append(kw))
    with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
        resubmit_on_crash(lambda params: None)(crash_once, _crashed_run([]), Crashed(message="status code: -9"))
    assert submitted == []
