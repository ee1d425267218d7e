"""What each pool needs (`slimtune plan`), and the base job templates rendered with it.

The Kubernetes template is rendered as Prefect renders a work pool's template (the variables' defaults, then the
job variables a run gets from `slimtune.plan.fit.job_variables`), with the two conversions Prefect's Kubernetes
worker applies before it creates the Job (`env` as a list of name/value pairs, `command` split into `args`), and
checked against the Kubernetes v1.34 batch/v1 Job schema in strict mode (no unknown fields).
`k8s_job_v1.34_strict.json` is that schema from kubernetes-validate 1.37.0 (PyPI; its wheel is 22 MB, so only
the Job schema and the definitions it references are kept here, descriptions dropped).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
from prefect.utilities.templating import apply_values

from slimtune.plan.fit import GPU_MEMORY_LABEL, Budget, job_variables, model_config, plan, pool_needs, render
from slimtune.spec.schema import PipelineSpec

_REPO = Path(__file__).resolve().parent.parent
_GIB = 1024**3
# Kubernetes' resource.Quantity syntax (the schema leaves it a plain string): digits, then a suffix.
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[mkMGTPE])?$")


def _rows(pools: dict, device: str = "auto"):
    """The plan of the tiny model for an 80 GiB card and 64 GiB of host memory."""
    spec = PipelineSpec.model_validate(
        {"model": {"name_or_path": "builtin:tiny-llama", "device": device}, "export": {"gguf": ["f16"]}, "pools": pools}
    )
    rows, _ = plan(spec, model_config(spec), Budget(80 * _GIB, None, 64 * _GIB))
    return spec, rows


def test_export_pool_takes_merge_and_gguf_on_the_cpu():
    spec, rows = _rows({"export": "cpu-hosts"})
    train, export = pool_needs(spec, rows)
    assert (train.pool, export.pool) == (None, "cpu-hosts")
    assert export.stages == ("dequant_merge", "gguf_convert_and_push")
    assert (train.gpus, export.gpus, export.gpu_memory_gib) == (1, 0, 0)
    est = {r.stage: r.estimate for r in rows}
    # on the CPU the merge's device working set (less the CUDA context) is host memory too
    merge = est["dequant_merge"]
    assert export.host_memory_gib * _GIB >= merge.host_bytes + merge.gpu_bytes - merge.context_gpu_bytes
    assert train.gpu_memory_gib * _GIB >= est["packed_sft"].gpu_bytes > (train.gpu_memory_gib - 1) * _GIB
    assert train.gpu_memory_class_gib >= train.gpu_memory_gib
    text = render(spec, rows, {"micro_batch": 1, "largest_micro_batch": 1, "largest_seq_len": 1}, Budget(None, None, 1))
    assert "- pool cpu-hosts: dequant_merge, gguf_convert_and_push: host " in text
    assert (
        f"- the deployment's pool: load_4bit, attach_lora, packed_sft, cleanup: 1 GPU x {train.gpu_memory_gib} GiB"
        in text
    )
    # without pools.export one pool runs all six stages, on the GPU
    spec, rows = _rows({})
    (one,) = pool_needs(spec, rows)
    assert one.pool is None and len(one.stages) == 6 and one.gpus == 1
    # a CPU run needs no GPU anywhere
    spec, rows = _rows({}, device="cpu")
    assert pool_needs(spec, rows)[0].gpus == 0


def _render_kubernetes(variables: dict) -> dict:
    template = json.loads((_REPO / "deployments" / "kubernetes" / "gpu-job-template.json").read_text())
    values = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    values |= {"name": "slimtune-run", "command": "prefect flow-run execute", **variables}
    manifest = apply_values(template["job_configuration"]["job_manifest"], values)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in container["env"].items()]  # as the worker does
    container["args"] = shlex.split(container["args"])  # as the worker does
    return manifest


def test_kubernetes_template_renders_valid_jobs_with_the_plans_figures():
    schema = json.loads((Path(__file__).parent / "k8s_job_v1.34_strict.json").read_text())
    spec, rows = _rows({"export": "cpu-hosts"})
    for needs in pool_needs(spec, rows):
        manifest = _render_kubernetes(job_variables(needs, "kubernetes"))
        jsonschema.validate(manifest, schema)
        pod = manifest["spec"]["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        for kind in ("requests", "limits"):
            assert resources[kind]["nvidia.com/gpu"] == needs.gpus
            assert resources[kind]["memory"] == f"{needs.host_memory_gib}Gi"
            assert resources[kind]["ephemeral-storage"] == f"{max(needs.disk_gib, 1)}Gi"
            assert all(_QUANTITY.match(str(q)) for q in resources[kind].values()), resources
        if needs.gpus:  # nodes whose cards hold the GPU figure
            (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"
            ][0]["matchExpressions"]
            assert term == {"key": GPU_MEMORY_LABEL, "operator": "Gt", "values": [str(needs.gpu_memory_gib * 1024 - 1)]}
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        else:  # any node: no GPU selector, no affinity
            assert pod["nodeSelector"] == {} and pod["affinity"] == {}
    # The check can fail: the template's env as Prefect leaves it (a mapping) is not a Job.
    bad = _render_kubernetes({})
    bad["spec"]["template"]["spec"]["containers"][0]["env"] = {"HF_HOME": "/cache"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_process_template_hands_the_figures_to_the_flow_run_environment(prefect_harness):
    """A process worker reserves nothing: the figures reach the flow run as SLIMTUNE_* variables, next to the
    deployment's own env, and are left out when a run sets none. (Prefect resolves block references through the
    API while it renders: the session's test server.)"""
    import asyncio

    from prefect.workers.process import ProcessJobConfiguration

    template = json.loads((_REPO / "deployments" / "process" / "gpu-hosts.json").read_text())
    spec, rows = _rows({"export": "cpu-hosts"})
    _, export = pool_needs(spec, rows)
    values = {**job_variables(export, "process"), "env": {"HF_HOME": "/cache"}, "working_dir": "/tmp"}

    async def configure(values: dict) -> dict:
        return (await ProcessJobConfiguration.from_template_and_values(template, values)).env

    env = asyncio.run(configure(values))
    assert env == {
        "HF_HOME": "/cache",
        "SLIMTUNE_GPUS": "0",
        "SLIMTUNE_GPU_MEMORY_GIB": "0",
        "SLIMTUNE_HOST_MEMORY_GIB": str(export.host_memory_gib),
        "SLIMTUNE_DISK_GIB": str(max(export.disk_gib, 1)),
    }
    assert asyncio.run(configure({"working_dir": "/tmp"})) == {}
