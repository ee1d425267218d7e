"""Pools by stage: training runs on one work pool, merge and GGUF on another (`pools.export`), as a fleet runs them.

A real `prefect server start` with two process pools, `gpu-stage` (training; it trains on the CPU here, with
model.device cpu) and `cpu-stage` (merge and GGUF), one worker on each, the finetune flow deployed on the first
and the export flow deployed as `finetune-export/cpu-stage` on the second, both from this checkout. The
shipped tiny-smoke spec with `pools.export: cpu-stage` is started from its deployment; the test reads from the
API which pool ran each flow run, which flow run ran each stage, and what the export run was placed with, reads
the workers' logs for which worker started which run, and checks the GGUF's llama.cpp verification.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from checkout_deploy import shipped_spec
from prefect_server import REPO, start_server, start_worker

from slimtune.plan.fit import Budget, job_variables, model_config, plan, pool_needs
from slimtune.spec.schema import PipelineSpec

_GPU_STAGE, _CPU_STAGE = "gpu-stage", "cpu-stage"
_RUN_TIMEOUT_S = 900  # 4 steps, a merge and one GGUF: ~2-3 min on 2 idle cores, much longer while others run

_DEPLOY = """
import json, sys
from prefect import flow

ids = []
for d in json.loads(sys.argv[1]):  # one process: the flows' imports are slow
    source = flow.from_source(source=d["repo"], entrypoint=d["entrypoint"])
    ids.append(str(source.deploy(
        name=d["name"], work_pool_name=d["pool"], job_variables=d["job_variables"], parameters=d["parameters"],
        print_next_steps=False,
    )))
print("deployment ids:", json.dumps(ids))
"""


def test_training_and_export_each_run_on_their_own_pool(tmp_path, request):
    began = time.monotonic()
    server = start_server(tmp_path / "home", request.addfinalizer)
    spec = {**shipped_spec("tiny-smoke.yaml", tmp_path / "runs"), "pools": {"export": _CPU_STAGE}}
    workdir = tmp_path / "worker"
    workdir.mkdir()
    template = REPO / "deployments" / "process" / "gpu-hosts.json"  # the shipped one: the plan's variables
    for pool in (_GPU_STAGE, _CPU_STAGE):
        server.create_process_pool(pool, template)
    # The workers boot (imports: 10-20 s each on a busy 2-core machine) while the deployments are made.
    for pool in (_GPU_STAGE, _CPU_STAGE):
        start_worker(server, pool, request.addfinalizer, cwd=workdir, log=f"worker-{pool}.log")
    deployments = [
        {
            "entrypoint": "slimtune/flows/finetune.py:finetune",
            "name": spec["name"],
            "pool": _GPU_STAGE,
            "job_variables": {"env": {"SLIMTUNE_GPU_SLOT": "cpu"}, "working_dir": str(workdir)},
            "parameters": {"spec": spec},
        },
        {  # named after its pool: `pools.export: cpu-stage` starts finetune-export/cpu-stage
            "entrypoint": "slimtune/flows/export.py:finetune_export",
            "name": _CPU_STAGE,
            "pool": _CPU_STAGE,
            "job_variables": {"working_dir": str(workdir)},
            "parameters": {},
        },
    ]
    done = subprocess.run(
        [sys.executable, "-c", _DEPLOY, json.dumps([{**d, "repo": str(REPO)} for d in deployments])],
        env=server.env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    train_id, export_id = json.loads(done.stdout.rsplit("deployment ids:", 1)[1])

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}), get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(train_id)
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        while time.monotonic() < deadline and not (run := client.read_flow_run(run.id)).state.is_final():
            time.sleep(2)
        logs = {pool: server.log(f"worker-{pool}.log") for pool in (_GPU_STAGE, _CPU_STAGE)}
        assert run.state.is_completed(), (
            f"{run.state}\n--- {_GPU_STAGE} ---\n{logs[_GPU_STAGE]}\n--- {_CPU_STAGE} ---\n{logs[_CPU_STAGE]}"
        )
        (export,) = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[export_id])))
        stages = {  # stage -> state, per flow run (task runs are named "<stage> [<run name>]")
            flow_run.id: {
                t.name.split(" [")[0]: t.state.type.value
                for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
            }
            for flow_run in (run, export)
        }
    total = time.monotonic() - began

    # Each flow run on its pool, started by that pool's worker.
    assert (run.work_pool_name, export.work_pool_name) == (_GPU_STAGE, _CPU_STAGE)
    assert export.state.is_completed(), export.state
    assert export.parent_task_run_id is not None  # a subflow of the training run: its page links to it
    worker_logs = {pool: (server.home / f"worker-{pool}.log").read_text(errors="replace") for pool in logs}
    for flow_run, pool, other in ((run, _GPU_STAGE, _CPU_STAGE), (export, _CPU_STAGE, _GPU_STAGE)):
        assert f"submitting flow run '{flow_run.id}'" in worker_logs[pool]
        assert f"submitting flow run '{flow_run.id}'" not in worker_logs[other]
    # Each stage in its flow run: training on the first pool, merge and GGUF on the second.
    assert {"load_4bit", "attach_lora", "packed_sft", "cleanup"} <= set(stages[run.id]), stages
    assert not {"dequant_merge", "gguf_convert_and_push"} & set(stages[run.id]), stages
    assert {"dequant_merge", "gguf_convert_and_push"} <= set(stages[export.id]), stages
    assert set(stages[export.id].values()) == {"COMPLETED"}, stages
    # The export run was placed with the plan's figures, which the pool's template handed to the flow run.
    parsed = PipelineSpec.model_validate(spec)
    rows, _ = plan(parsed, model_config(parsed), Budget(None, None, None))
    placed = export.job_variables
    assert placed == job_variables(pool_needs(parsed, rows)[1], "process") and placed["gpus"] == 0, placed
    figures = f"'SLIMTUNE_HOST_MEMORY_GIB': '{placed['host_memory_gib']}'"
    assert figures in worker_logs[_CPU_STAGE], worker_logs[_CPU_STAGE][-3000:]

    # The GGUF exists and verifies in llama.cpp; the training run's report has the export run's results.
    run_dir = tmp_path / "runs" / spec["name"]
    summary = json.loads((run_dir / "report.json").read_text())
    gguf = run_dir / "gguf" / f"{spec['name']}-f16.gguf"
    assert gguf.is_file() and summary["gguf_convert_and_push"]["files"][gguf.name] == gguf.stat().st_size
    check = summary["gguf_convert_and_push"]["verification"][gguf.name]
    # f16 weights against the float32 merged model: the bound tests/test_gguf_quant_verify.py holds f16 to
    assert check["token_ids_equal"] and check["argmax_agreement"] >= 0.99 and check["max_abs_logit_diff"] < 0.5, check
    assert Path(summary["dequant_merge"]["out_dir"]).resolve() == (run_dir / "merged").resolve()
    merge = next(m for m in summary["memory"] if m["stage"] == "dequant_merge")  # written on the export host
    rss, estimate = merge["peak_host_rss"] / 2**20, merge["estimate"]["host_bytes"] / 2**20
    print(
        f"two-pool run: {total:.0f} s; CPU merge {merge['seconds']:.2f} s, peak RSS {rss:.0f} MiB (est. {estimate:.0f})"
    )
