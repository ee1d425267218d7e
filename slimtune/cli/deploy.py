"""`slimtune deploy`: register a spec as a Prefect deployment whose runs carry the plan's job variables.

The training pool's figures (GPUs, GPU memory, host memory, disk) come from `slimtune plan`; typed by hand into
`--job-variable` flags they drift from the spec the moment it changes. The export run of `pools.export` already
gets its figures from the plan when the training run starts it (`slimtune.flows.export`); this gives the
training deployment its own the same way. It uses Prefect's `flow.from_source(...).to_deployment(...).apply()`,
the Python form of `prefect deploy` (what `Flow.deploy` does for a pool without images, minus its printed
table): a deployment made from a spec file on the command line needs no prefect.yaml entry, and the same call
registers the schedules and the export deployment.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slimtune.core.placement import CPU_SLOT, EXPORT_ENTRYPOINT, FINETUNE_ENTRYPOINT, work_queue
from slimtune.plan.fit import Budget, job_variables, model_config, plan, pool_needs
from slimtune.spec.schema import PipelineSpec

# This installation's checkout: a worker on this host (or one that mounts it at the same path) runs from it
_CHECKOUT = Path(__file__).resolve().parents[2]


class DeployError(ValueError):
    """Input `slimtune deploy` cannot use (no server, an unknown work pool, a bad cron), named with its fix."""


def training_job_variables(spec: PipelineSpec, pool_type: str) -> dict[str, Any]:
    """The job variables of the deployment's own pool: the stages `pools.export` does not take (all of them
    without it), as `slimtune plan` sizes them, for a `pool_type` pool ("process", "kubernetes")."""
    rows, _ = plan(spec, model_config(spec), Budget(None, None, None))  # no budget: needs, not verdicts
    (needs,) = [n for n in pool_needs(spec, rows) if n.pool is None]
    variables = job_variables(needs, pool_type)
    if spec.model.device == "cpu":  # as prefect.yaml's CPU deployments: its own slot, never a GPU's
        variables["env"] = {"SLIMTUNE_GPU_SLOT": CPU_SLOT}
    return variables


def deploy(spec: PipelineSpec, pool: str, *, crons: Sequence[str] = (), source: str | None = None) -> dict[str, Any]:
    """Deploy `finetune/<spec.name>` on `pool` with the plan's job variables (and `finetune-export/<pools.export>`
    on that pool when the spec sets it); returns what was registered.

    Args:
        crons: schedules (cron, UTC), active.
        source: where workers get the code: a git URL (cloned for every run, as prefect.yaml's pull steps do) or
            a directory; default this installation's checkout.

    Raises:
        DeployError: no Prefect server is configured, a work pool does not exist, a cron expression is not one
            (each message gives the fix).
    """
    from prefect import flow
    from prefect.settings import get_current_settings

    if get_current_settings().api.url is None:  # Prefect would register it in a temporary local server
        raise DeployError(
            "no Prefect server to deploy to; set PREFECT_API_URL=http://<server>:4200/api (docs/deployments.md)"
        )
    schedules = [_cron(c) for c in crons]
    pool_type = _pool_type(pool)
    variables = training_job_variables(spec, pool_type)
    queue = work_queue(variables["gpus"])
    where = source or str(_CHECKOUT)
    training = flow.from_source(source=where, entrypoint=FINETUNE_ENTRYPOINT).to_deployment(
        name=spec.name,
        work_pool_name=pool,
        work_queue_name=queue,
        job_variables=variables,
        # unset optional fields left out: the parameter schema has no null branch for them (as flows/resubmit.py's)
        parameters={"spec": spec.model_dump(mode="json", exclude_none=True)},
        schedules=schedules,
    )
    deployment_id = training.apply()  # `deploy` does this too, and prints a table to stdout, where the JSON goes
    done: dict[str, Any] = {
        "deployment": f"finetune/{spec.name}",
        "id": str(deployment_id),
        "pool": pool,
        "queue": queue,
        "job_variables": variables,
    }
    if spec.pools.export:  # the training run fills its parameters and job variables when it starts it
        _pool_type(spec.pools.export)
        export = flow.from_source(source=where, entrypoint=EXPORT_ENTRYPOINT)
        export.to_deployment(name=spec.pools.export, work_pool_name=spec.pools.export).apply()
        done["export_deployment"] = f"{export.name}/{spec.pools.export}"
    return done


def _cron(expression: str):
    from prefect.schedules import Cron

    try:
        return Cron(expression, timezone="UTC")
    except ValueError:  # pydantic's ValidationError is one
        raise DeployError(
            f"cron {expression!r} is not a cron expression; give e.g. '0 3 * * *' (03:00 UTC daily)"
        ) from None


def _pool_type(pool: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_work_pool(pool).type
        except ObjectNotFound:
            raise DeployError(
                f"work pool {pool!r} not found; create it with `prefect work-pool create {pool} --type process "
                "--base-job-template deployments/process/gpu-hosts.json` (docs/deployments.md)"
            ) from None
