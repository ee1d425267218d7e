"""The six stages as Prefect tasks: thin wrappers that add the memory guard, retries and downshifts.

Each wrapper estimates what its stage needs, runs the plain function from `slimtune.tasks` under
`guarded(...)`, and returns a small JSON-able dict (never a model: Prefect keeps task results alive
until the flow ends). Out-of-memory inside a stage becomes `MemoryPressure`, the only error
`retry_on_memory_pressure` retries; on the retry the wrapper reads `run_count` and downshifts.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from slimtune.core import atomic
from slimtune.flows import ranks
from slimtune.memory import (
    Estimate,
    GuardRecord,
    current_attempt,
    downshift_merge,
    estimate_export,
    estimate_load_4bit,
    estimate_merge,
    guarded,
    retry_on_memory_pressure,
)
from slimtune.memory.guard import gpu_shortfalls
from slimtune.plan.fit import DTYPE_BYTES
from slimtune.plan.run_plan import RunPlan
from slimtune.plan.train_settings import card_bytes, resolve_train
from slimtune.report.charts import publish_memory_chart
from slimtune.report.memory_report import publish_task_report
from slimtune.spec.schema import STAGES, PipelineSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.cleanup import cleanup
from slimtune.tasks.dequant_merge import dequant_merge
from slimtune.tasks.gguf_convert_and_push import gguf_convert_and_push
from slimtune.tasks.load_4bit import load_4bit, tables_on_host
from slimtune.tasks.packed_sft import packed_sft

log = logging.getLogger(__name__)


def _save_record(spec: PipelineSpec):
    """Publish a stage's memory record and keep it on disk (the flow's memory report reads them back)."""

    def save(record: GuardRecord) -> None:
        publish_task_report(record)
        atomic.write_json(spec.run_dir() / "memory" / f"{record.stage}.json", asdict(record))
        publish_memory_chart(load_records(spec.run_dir() / "memory"), spec.name)  # it grows stage by stage

    return save


def load_records(memory_dir: Path) -> list[GuardRecord]:
    """The stage records saved by `_save_record`, in pipeline order."""
    records = []
    for stage in STAGES:
        path = memory_dir / f"{stage}.json"
        if path.is_file():
            raw = json.loads(path.read_text())
            raw["estimate"] = Estimate(**raw["estimate"]) if raw.get("estimate") else None
            records.append(GuardRecord(**raw))
    return records


def _guard(stage: str, spec: PipelineSpec, plan: RunPlan, estimate: Estimate | None, downshifts: tuple[str, ...] = ()):
    """The memory guard around one stage (a null context when the spec turns the guard off)."""
    if not spec.guard.enabled:
        return contextlib.nullcontext()
    return guarded(
        stage,
        estimate=estimate if spec.guard.preflight else None,
        device=plan.device,
        budget_fraction=spec.guard.gpu_memory_fraction,
        disk_path=spec.run_dir(),
        downshifts=list(downshifts),
        on_exit=_save_record(spec),
    )


def _task(name: str, run_name: str):
    return task(
        name=name,
        task_run_name=run_name,
        cache_policy=NO_CACHE,
        retry_condition_fn=retry_on_memory_pressure,
        retry_delay_seconds=0,
    )


def gpu_fits(est: Estimate, spec: PipelineSpec, plan: RunPlan) -> bool:
    """Whether `est` passes the guard's GPU preflight now (device free memory and the spec's budget)."""
    dev = plan.torch_device
    if dev.type != "cuda":
        return True
    return not gpu_shortfalls(est, dev, spec.guard.gpu_memory_fraction)


@_task("load_4bit", "load_4bit [{spec.name}]")
def load_4bit_task(spec: PipelineSpec, plan: RunPlan) -> dict:
    """Load the base model in NF4; the model stays in the process registry."""

    def here() -> dict:
        est = estimate_load_4bit(
            plan.config, compute_dtype_bytes=plan.dtype.itemsize, host_tables=tables_on_host(spec, plan)
        )
        with _guard("load_4bit", spec, plan, est):
            return load_4bit(spec, plan).to_dict()

    return ranks.run_stage(spec, "load_4bit", here)


@_task("attach_lora", "attach_lora [{spec.name}]")
def attach_lora_task(spec: PipelineSpec, plan: RunPlan, handle: str | None) -> dict:
    """Attach LoRA and the chosen gradient checkpointing."""

    def here() -> dict:
        with _guard("attach_lora", spec, plan, None):
            return attach_lora(spec, handle, plan).to_dict()

    return ranks.run_stage(spec, "attach_lora", here)


@_task("packed_sft", "packed_sft [{spec.name}]")
def packed_sft_task(
    spec: PipelineSpec, plan: RunPlan, handle: str | None, checkpointing_handle: str | None, examples_handle: str
) -> dict:
    """Train; each out-of-memory retry halves the micro-batch (doubling accumulation), then offloads."""
    train = resolve_train(
        spec,
        plan.config,
        plan.torch_device.type,
        attempt=current_attempt(),
        fits=lambda est: gpu_fits(est, spec, plan),
        card=card_bytes(spec, plan.torch_device),
    )
    if train.auto_note:
        log.warning("packed_sft %s", train.auto_note)
    for note in train.downshift_notes:
        log.warning("packed_sft downshift: %s", note)
    if train.graphs_off:
        log.warning("packed_sft: CUDA graphs of the layers' backward off: %s", train.graphs_off)
    if train.stored_note:
        log.warning("packed_sft stored layers %s", train.stored_note)
    if train.head_note:
        log.warning("packed_sft: %s", train.head_note)
    batch = {
        "micro_batch_size": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_checkpointing": train.checkpointing,
    }

    def here() -> dict:
        report = packed_sft(
            spec,
            handle,
            checkpointing_handle,
            examples_handle,
            **batch,
            plan=plan,
            cuda_graphs=train.cuda_graphs,
            stored_layers=train.stored_layers,
        )
        return {**asdict(report), "micro_batch_auto": train.auto_note, "stored_layers_auto": train.stored_note}

    # a cluster's ranks run on other machines: this machine's GPU is no measure of whether they fit
    estimate = None if spec.train.cluster else train.estimate
    with _guard("packed_sft", spec, plan, estimate, train.downshift_notes):
        return ranks.run_stage(spec, "packed_sft", here, **batch)


@_task("cleanup", "cleanup [{spec.name}]")
def cleanup_task(spec: PipelineSpec, plan: RunPlan, baseline: dict) -> dict:
    """Free every live model and check memory is back to where the run started."""
    with _guard("cleanup", spec, plan, None):
        return cleanup(baseline).to_dict()


@_task("dequant_merge", "dequant_merge [{spec.name}]")
def dequant_merge_task(spec: PipelineSpec, plan: RunPlan, adapter_dir: str) -> dict:
    """Merge tensor by tensor; each out-of-memory retry lowers maximum_memory_usage by 0.1."""
    shift = downshift_merge(spec.merge.maximum_memory_usage, current_attempt())
    for note in shift.notes:
        log.warning("dequant_merge downshift: %s", note)
    est = estimate_merge(
        plan.config,
        max_shard_bytes=int(spec.merge.max_shard_size_gb * 1e9),
        output_dtype_bytes=DTYPE_BYTES.get(spec.merge.output_dtype, 2),
    )
    with _guard("dequant_merge", spec, plan, est, shift.notes):
        return dequant_merge(spec, adapter_dir, maximum_memory_usage=shift.maximum_memory_usage, plan=plan).to_dict()


@_task("gguf_convert_and_push", "gguf_convert_and_push [{spec.name}]")
def gguf_task(spec: PipelineSpec, plan: RunPlan, merged_dir: str, adapter_dir: str, summary: dict) -> dict:
    """Convert to GGUF, verify in llama.cpp, and push to the Hub when the spec says so."""
    est = estimate_export(plan.config, out_types=spec.export.gguf)  # merging keeps the base model's shape
    with _guard("gguf_convert_and_push", spec, plan, est):
        return gguf_convert_and_push(spec, Path(merged_dir), Path(adapter_dir), summary, plan).to_dict()


@_task("eval_prompts", "eval_prompts [{spec.name}]")
def eval_prompts_task(spec: PipelineSpec, plan: RunPlan, merged_dir: str) -> list[dict]:
    """Base and fine-tuned answers to eval.prompts, side by side (one model loaded at a time)."""
    from slimtune.inference.evaluate import compare_generations

    with _guard("eval_prompts", spec, plan, None):
        return compare_generations(
            Path(plan.model_dir),
            Path(merged_dir),
            spec.eval.prompts,
            max_new_tokens=spec.eval.max_new_tokens,
            device=plan.device,
        )
