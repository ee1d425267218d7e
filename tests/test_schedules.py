"""A deployed schedule fires: Prefect's scheduler creates the flow run and a process worker runs it to Completed.

Under SQLAlchemy 2.1, Prefect 3.8.8's scheduler service fails on every loop ("Can't evaluate bulk DML
statement") and creates no scheduled runs, while the deployment shows its schedule as registered; pyproject.toml
bounds SQLAlchemy below 2.1. Only a real server runs the scheduler, so this test starts one (its scheduler
loop shortened from 60 s), deploys the shipped canary spec (tiny-smoke, 4 steps on the CPU pool) with a
schedule whose first run is due shortly after, and waits for that run to be created and completed.
"""

from __future__ import annotations

import time
from datetime import timedelta

from checkout_deploy import deploy_with_worker, shipped_spec
from prefect_server import start_server

# After the deployment is made (a few seconds on a busy host): the scheduler never creates a run due in the past.
# The worker is up by then (deploy_with_worker starts it first), so the run waits for this margin and no more.
_FIRST_RUN_IN_S = 20
_RUN_TIMEOUT_S = 600  # the 4-step pipeline takes ~1-2 min on 2 idle cores; much longer while the suite runs
# The scheduler inserts runs every loop (60 s by default); a deployment changed in the last few seconds is
# scheduled sooner by the "recent deployments" loop (5 s by default). Both short here, so the run exists well
# before it is due, whichever loop creates it.
_FAST_SCHEDULER = {
    "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
    "PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "2",
}


def test_a_deployed_schedule_creates_a_run_that_a_worker_completes(tmp_path, request):
    server = start_server(tmp_path / "home", request.addfinalizer, extra_env=_FAST_SCHEDULER)
    spec = shipped_spec("tiny-smoke.yaml", tmp_path / "runs")
    workdir = tmp_path / "worker"
    workdir.mkdir()
    began = time.monotonic()
    deployment_id = deploy_with_worker(server, spec, workdir, request.addfinalizer, first_run_in_s=_FIRST_RUN_IN_S)

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}), get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
        (schedule,) = deployment.schedules
        assert schedule.active and schedule.schedule.interval == timedelta(hours=1)
        first_due = schedule.schedule.anchor_date
        assert first_due > deployment.created, "the first run was due before the deployment existed; raise the margin"
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        run = None
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
            )
            due = [r for r in runs if r.expected_start_time == first_due]
            run = due[0] if due else None
            if run is not None and run.state is not None and run.state.is_final():
                break
            time.sleep(2)
    assert run is not None, f"the scheduler created no run in {_RUN_TIMEOUT_S} s\n{server.log('server.log')}"
    assert run.auto_scheduled, "the run was not created by the scheduler"
    assert run.state.is_completed(), f"{run.state}\n--- worker ---\n{server.log('worker.log')}"
    assert (tmp_path / "runs" / spec["name"] / "report.json").is_file()  # the pipeline ran to its report
    assert "Can't evaluate bulk DML" not in (server.home / "server.log").read_text(errors="replace")
    lag = (run.created - deployment.created).total_seconds()
    print(f"scheduled run created {lag:.1f} s after the deployment; test took {time.monotonic() - began:.0f} s")
