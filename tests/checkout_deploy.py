"""Deploy a shipped spec straight from this checkout to a process work pool of a test server, with a worker.

tests/test_deploy.py runs `prefect deploy --all` from a git clone, as a user does. Tests of what comes after
deployment (the run form, schedules) need no clone: here the worker runs the flow from the checkout, on the
pool and queue `deployments/render_prefect_yaml.py` chooses for the spec, with the run directory under the
test's tmp folder.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect_server import REPO, Server, start_worker

_DEPLOY = """
import json, sys
from datetime import datetime, timedelta, timezone
from prefect import flow
from prefect.schedules import Interval

args = json.loads(sys.argv[1])
source = flow.from_source(source=args["repo"], entrypoint="slimtune/flows/finetune.py:finetune")  # imports: slow
schedules = []
if args["first_run_in_s"] is not None:  # anchored so that its first run is due shortly after the deployment
    anchor = datetime.now(timezone.utc) + timedelta(seconds=args["first_run_in_s"])
    schedules = [Interval(timedelta(hours=1), anchor_date=anchor, timezone="UTC")]
print(source.deploy(
    name=args["name"], work_pool_name=args["pool"], work_queue_name=args["queue"], job_variables=args["job_variables"],
    parameters={"spec": args["spec"]}, schedules=schedules, print_next_steps=False,
))
"""


def renderer() -> Any:
    """deployments/render_prefect_yaml.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(
        "render_prefect_yaml", REPO / "deployments" / "render_prefect_yaml.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shipped_spec(filename: str, output_dir: Path) -> dict[str, Any]:
    """The `spec` parameter prefect.yaml deploys for `deployments/<filename>`, its run directory moved."""
    spec = renderer().deploy_parameters(REPO / "deployments" / filename)["spec"]
    return {**spec, "output_dir": str(output_dir)}


def deploy_with_worker(
    server: Server,
    spec: dict[str, Any],
    workdir: Path,
    finalize: Callable[[Callable[[], None]], None],
    *,
    first_run_in_s: float | None = None,
) -> str:
    """Create the spec's work pool, deploy `finetune/<spec name>` there and start a worker; returns the deployment id.

    Args:
        first_run_in_s: give the deployment an hourly schedule whose first run is due this many seconds after
            the deployment is made; None: no schedule.
    """
    placement = renderer().placement(spec)
    server.create_process_pool(placement["name"])
    # The worker boots (its imports: 10-20 s on a busy 2-core machine) while the deployment is made; it polls
    # the pool every second, so it picks up the first run the same as when started after the deployment.
    start_worker(server, placement["name"], finalize, cwd=workdir)
    args = {
        "repo": str(REPO),
        "name": spec["name"],
        "pool": placement["name"],
        "queue": placement["work_queue_name"],
        "job_variables": placement["job_variables"],
        "spec": spec,
        "first_run_in_s": first_run_in_s,
    }
    done = subprocess.run(
        [sys.executable, "-c", _DEPLOY, json.dumps(args)],
        env=server.env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]
