"""Merge and GGUF as a flow of their own, so that a run can hand them to another work pool (`pools.export`).

Training holds its GPUs until cleanup; dequant_merge and gguf_convert_and_push read only the adapter and the
base model's files, and the merge already works tensor by tensor in a small device budget. A fleet therefore
runs them on a CPU host with the host memory and disk `slimtune plan` shows (`pool_needs`) and frees the GPU
for the next run. The hand-off goes through the run directory, which both pools must mount at the same path:
the adapter is read from it, and the export flow's summary comes back in `export.json` beside it (flow
results are not persisted across hosts by default).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prefect import flow
from prefect.client.schemas.objects import WorkPool
from prefect.client.schemas.responses import DeploymentResponse
from prefect.deployments import run_deployment
from prefect.runtime import deployment, flow_run

from slimtune.core import atomic
from slimtune.core.placement import EXPORT_ENTRYPOINT
from slimtune.flows.progress import start_stage
from slimtune.flows.stages import dequant_merge_task, eval_prompts_task, gguf_task
from slimtune.plan.fit import POOL_STAGES, Budget, job_variables, pool_needs
from slimtune.plan.fit import plan as plan_stages
from slimtune.plan.run_plan import RunPlan, resolve_plan
from slimtune.report.run_log import run_logger
from slimtune.spec.schema import PipelineSpec

EXPORT_FLOW = "finetune-export"
_RESULT = "export.json"
# What deployments/process/gpu-hosts.json sets from the job variables of `slimtune.plan.fit.job_variables`
_PLACEMENT_ENV = ("SLIMTUNE_GPUS", "SLIMTUNE_GPU_MEMORY_GIB", "SLIMTUNE_HOST_MEMORY_GIB", "SLIMTUNE_DISK_GIB")


def export_stages(spec: PipelineSpec, plan: RunPlan, adapter_dir: str, card_facts: dict) -> dict:
    """dequant_merge, the eval prompts and gguf_convert_and_push in this process; the summary entries they make."""
    merge, export = (t.with_options(retries=spec.guard.max_retries) for t in (dequant_merge_task, gguf_task))
    out: dict = {}
    start_stage(spec, plan, "dequant_merge")
    out["dequant_merge"] = merged = merge(spec, plan, adapter_dir)
    if spec.eval.prompts:
        out["prompts"] = eval_prompts_task(spec, plan, merged["out_dir"])
    if spec.export.gguf or spec.export.push:
        start_stage(spec, plan, "gguf_convert_and_push")
        out["gguf_convert_and_push"] = export(spec, plan, merged["out_dir"], adapter_dir, card_facts)
    return out


@flow(name=EXPORT_FLOW, flow_run_name="{spec.name}: merge and GGUF", log_prints=True)
def finetune_export(spec: PipelineSpec, compute_dtype: str, adapter_dir: str, card_facts: dict) -> dict:
    """Merge `adapter_dir` into the base and export GGUF on this host's CPU; returns the summary entries.

    `compute_dtype` is the training run's: a dequantized merge re-quantizes the base in it, as load_4bit did.
    """
    placed = {k: v for k, v in os.environ.items() if k in _PLACEMENT_ENV}
    run_logger().info("merge and GGUF on the CPU of this host, placed with %s", placed or "no figures")
    model = spec.model.model_copy(update={"device": "cpu", "compute_dtype": compute_dtype})
    spec = spec.model_copy(update={"model": model})
    out = export_stages(spec, resolve_plan(spec), adapter_dir, card_facts)
    atomic.write_json(spec.run_dir() / _RESULT, {"flow_run_id": str(flow_run.id), "summary": out})
    return out


def hands_off(spec: PipelineSpec) -> bool:
    """Whether merge and GGUF go to `pools.export`: only for a run started from a deployment (a local
    `slimtune run` has no worker to hand them to; it runs them itself and says so). Checked before training.

    Raises:
        RuntimeError: the pool has no export deployment (the message gives the command that makes one).
    """
    if not spec.pools.export:
        return False
    if deployment.id is None:
        run_logger().warning(
            "pools.export %s ignored: not a deployment's run, so merge and GGUF run here", spec.pools.export
        )
        return False
    _export_deployment(spec)
    return True


def _export_deployment(spec: PipelineSpec) -> tuple[str, DeploymentResponse, WorkPool]:
    """The export deployment's name, the deployment and its work pool."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    name, pool = f"{EXPORT_FLOW}/{spec.pools.export}", spec.pools.export
    with get_client(sync_client=True) as client:
        try:
            target = client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise RuntimeError(
                f"pools.export: no deployment {name}; make it with `prefect deploy {EXPORT_ENTRYPOINT} -n {pool} "
                f"-p {pool}`, or remove pools.export"
            ) from None
        return name, target, client.read_work_pool(target.work_pool_name)


def export_on_pool(spec: PipelineSpec, plan: RunPlan, adapter_dir: str, card_facts: dict) -> dict:
    """Run `finetune-export/<pools.export>` with the job variables of the export stages' needs; wait for it.

    Raises:
        RuntimeError: the export flow run did not complete, or its results are not in this run directory.
    """
    name, _, pool = _export_deployment(spec)
    rows, _ = plan_stages(spec, plan.config, Budget(None, None, None))  # no budget: needs, not verdicts
    (needs,) = [n for n in pool_needs(spec, rows) if n.stages == POOL_STAGES["export"]]
    variables = job_variables(needs, pool.type)
    run_logger().info("merge and GGUF go to %s on pool %s with %s", name, pool.name, variables)
    # absolute: each pool's worker starts its flow runs in a clone of its own, where "runs" is another folder
    spec = spec.model_copy(update={"output_dir": str(Path(spec.output_dir).expanduser().resolve())})
    parameters = {
        "spec": spec.model_dump(mode="json"),
        "compute_dtype": plan.compute_dtype,
        "adapter_dir": str(Path(adapter_dir).resolve()),
        "card_facts": card_facts,
    }
    run = run_deployment(name, parameters=parameters, job_variables=variables, timeout=None)
    if not run.state or not run.state.is_completed():
        raise RuntimeError(
            f"pools.export: {name} on pool {pool.name} ended {run.state and run.state.name}; see its log"
        )
    result_file = spec.run_dir() / _RESULT
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if result.get("flow_run_id") != str(run.id):
        raise RuntimeError(
            f"pools.export: {result_file} does not hold the results of {name}'s run {run.id}: the run directory must "
            "be on a filesystem both pools mount at the same path"
        )
    return result["summary"]
