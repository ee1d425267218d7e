"""Where a deployment of the flow runs: its entrypoints, the work queue for its GPU count, the CPU runs' slot.

Read by the prefect.yaml renderer (deployments/render_prefect_yaml.py), `slimtune deploy` and the export
hand-off, so that a deployment made either way lands where the workers of docs/deployments.md look for it.
"""

from __future__ import annotations

FINETUNE_ENTRYPOINT = "slimtune/flows/finetune.py:finetune"
# Merge and GGUF of runs whose spec sets `pools.export: <pool>` run as the deployment `finetune-export/<pool>`;
# the finetune run fills its parameters and job variables.
EXPORT_ENTRYPOINT = "slimtune/flows/export.py:finetune_export"
# The flow holds one slot per GPU of the global concurrency limit SLIMTUNE_GPU_SLOT names ("gpu" by default);
# a CPU deployment names its own, so a CPU run never takes a GPU's slot.
CPU_SLOT = "cpu"


def work_queue(gpus: int) -> str:
    """The queue of the workers that see `gpus` GPUs: a 2-GPU run picked up by a worker that sees one fails."""
    return "default" if gpus <= 1 else f"gpus-{gpus}"
