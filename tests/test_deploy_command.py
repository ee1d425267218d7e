"""`slimtune deploy`: the training deployment's job variables come from the plan, not from numbers typed by hand.

On the session's Prefect test server (a real API server on SQLite): work pools made from the shipped base job
templates, `slimtune deploy` run as a user runs it, and the deployments read back from the API.
"""

from __future__ import annotations

import json

import pytest
from prefect_server import REPO

from slimtune.cli.main import main
from slimtune.plan.fit import Budget, job_variables, model_config, plan, pool_needs
from slimtune.spec.schema import load_spec

_SPEC = REPO / "deployments" / "tiny.yaml"
_TEMPLATES = {
    "process": REPO / "deployments" / "process" / "gpu-hosts.json",
    "kubernetes": REPO / "deployments" / "kubernetes" / "gpu-job-template.json",
}


def _create_pool(name: str, pool_type: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    template = json.loads(_TEMPLATES[pool_type].read_text())
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))


def _read_deployment(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


@pytest.mark.parametrize("pool_type", ["process", "kubernetes"])
def test_deploy_gives_the_training_deployment_the_plans_job_variables(prefect_harness, pool_type, tmp_path, capsys):
    """A 2-GPU spec whose merge and GGUF go to a CPU pool: the training deployment carries the figures of the
    training stages alone (GPU count and memory, host memory, disk), in the form its pool's template takes."""
    gpu_pool, cpu_pool = f"train-{pool_type}", f"export-{pool_type}"
    _create_pool(gpu_pool, pool_type)
    _create_pool(cpu_pool, "process")
    name = f"deploy-{pool_type}"
    sets = ["model.device=auto", "train.num_gpus=2", f"pools.export={cpu_pool}", f"name={name}"]
    sets.append(f"output_dir={tmp_path / 'runs'}")
    argv = ["deploy", str(_SPEC), "--pool", gpu_pool, "--cron", "0 3 * * *"]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    printed = json.loads(capsys.readouterr().out)

    spec = load_spec(_SPEC, sets)
    rows, _ = plan(spec, model_config(spec), Budget(None, None, None))
    train, export = pool_needs(spec, rows)
    assert (train.gpus, export.gpus) == (2, 0) and train.gpu_memory_class_gib >= train.gpu_memory_gib > 0
    assert train.stages == ("load_4bit", "attach_lora", "packed_sft", "cleanup")
    expected = job_variables(train, pool_type)
    deployment = _read_deployment(f"finetune/{name}")
    assert deployment.job_variables == printed["job_variables"] == expected
    assert expected["gpus"] == 2 and expected["host_memory_gib"] == train.host_memory_gib > 0
    assert expected["disk_gib"] == max(train.disk_gib, 1)
    if pool_type == "kubernetes":  # the memory class goes to the scheduler as a node affinity, in MiB
        (term,) = expected["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ][0]["matchExpressions"]
        assert term["values"] == [str(train.gpu_memory_gib * 1024 - 1)]
    else:
        assert expected["gpu_memory_gib"] == train.gpu_memory_gib
    assert (deployment.work_pool_name, deployment.work_queue_name) == (gpu_pool, "gpus-2")
    assert deployment.parameters == {"spec": spec.model_dump(mode="json", exclude_none=True)}
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in deployment.schedules] == [
        ("0 3 * * *", "UTC", True)
    ]
    assert _read_deployment(f"finetune-export/{cpu_pool}").work_pool_name == cpu_pool


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pool", "no-such-pool"], "work pool 'no-such-pool' not found; create it with `prefect work-pool create"),
        (["--pool", "p", "--cron", "every day"], "cron 'every day' is not a cron expression; give e.g."),
    ],
)
def test_deploy_refuses_bad_input_in_one_line(prefect_harness, extra, message, capsys):
    assert main(["deploy", str(_SPEC), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slimtune: error: DeployError: {message}") and err.count("\n") == 1, err


def test_deploy_needs_a_prefect_server(capsys):
    """Without PREFECT_API_URL Prefect would register the deployment in a temporary local server, for nobody."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["deploy", str(_SPEC), "--pool", "gpu-hosts"]) == 2
    err = capsys.readouterr().err
    assert err == "slimtune: error: DeployError: no Prefect server to deploy to; set PREFECT_API_URL=" + (
        "http://<server>:4200/api (docs/deployments.md)\n"
    ), err
