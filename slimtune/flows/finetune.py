"""The finetune flow: load_4bit -> attach_lora -> packed_sft -> cleanup -> dequant_merge -> gguf_convert_and_push."""

from __future__ import annotations

import time
from dataclasses import asdict

from prefect import flow
from prefect.runtime import flow_run

from slimtune.core import atomic, registry
from slimtune.flows.earlier_outputs import set_aside_earlier_outputs
from slimtune.flows.export import export_on_pool, export_stages, hands_off
from slimtune.flows.gpu_slots import gpu_concurrency, gpu_slot
from slimtune.flows.progress import finish_run, start_stage
from slimtune.flows.resubmit import crash_downshift, resubmit_on_crash
from slimtune.flows.run_lock import run_lock
from slimtune.flows.stages import (
    attach_lora_task,
    cleanup_task,
    load_4bit_task,
    load_records,
    packed_sft_task,
)
from slimtune.inference.evaluate import held_out_metrics
from slimtune.plan.run_plan import resolve_plan
from slimtune.report.charts import publish_memory_chart
from slimtune.report.memory_report import publish_memory_report
from slimtune.report.run_report import write_run_report
from slimtune.spec.overrides import effective_yaml
from slimtune.spec.schema import MAX_CRASH_RESUBMITS, PipelineSpec, recheck_paths
from slimtune.tasks.cleanup import MemorySnapshot
from slimtune.tasks.packed_sft import prepare_data


def _flow_run_name() -> str:
    spec = flow_run.parameters.get("spec") or {}
    if isinstance(spec, PipelineSpec):
        spec = spec.model_dump()
    model = (spec.get("model") or {}).get("name_or_path", "?")
    sources = (spec.get("data") or {}).get("sources") or []
    data = f"{len(sources)} sources" if sources else str((spec.get("data") or {}).get("path", "?")).rsplit("/", 1)[-1]
    return f"{spec.get('name', 'run')}: {model} on {data}"


# The hook's own bound is the spec field's maximum; crash_downshift applies guard.max_crash_resubmits.
@flow(
    name="finetune",
    flow_run_name=_flow_run_name,
    log_prints=True,
    on_crashed=[resubmit_on_crash(crash_downshift, max_resubmits=MAX_CRASH_RESUBMITS)],
)
def finetune(spec: PipelineSpec) -> dict:
    """Fine-tune `spec.model` with QLoRA on `spec.data`, merge, and export GGUF; returns the run summary."""
    began = time.perf_counter()
    spec = recheck_paths(spec)
    plan = resolve_plan(spec)  # model folder, config, family, device, dtype: once, then passed to every task
    examples = prepare_data(spec, plan.model_dir)  # bad data fails here, before any model is loaded
    baseline = MemorySnapshot.take().to_dict()
    summary: dict = {"spec": spec.model_dump(mode="json")}
    load, attach, train, clean = (
        t.with_options(retries=spec.guard.max_retries)
        for t in (load_4bit_task, attach_lora_task, packed_sft_task, cleanup_task)
    )
    remote = spec.merge.enabled and hands_off(spec)
    try:
        with run_lock(spec.run_dir()):  # one run per run dir
            # then its GPUs: the limit counts GPUs, a 2-GPU run holds 2 slots
            with gpu_concurrency(gpu_slot(), gpus=spec.train.num_gpus):
                start_stage(spec, plan, "load_4bit")
                summary["load_4bit"] = loaded = load(spec, plan)
                start_stage(spec, plan, "attach_lora")
                summary["attach_lora"] = lora = attach(spec, plan, loaded["handle"])
                start_stage(spec, plan, "packed_sft")
                summary["packed_sft"] = trained = train(
                    spec, plan, lora["handle"], lora["checkpointing_handle"], examples
                )
                if trained.get("reused_from") is None:  # a new adapter: the earlier merge and GGUFs are not its
                    set_aside_earlier_outputs(spec.run_dir())
                # what ran, from the first output this run publishes (a run failing before it changes nothing)
                atomic.write_text(spec.run_dir() / "spec.effective.yaml", effective_yaml(spec))
                summary["evaluation"] = held_out_metrics(trained)
                start_stage(spec, plan, "cleanup")
                summary["cleanup"] = clean(spec, plan, baseline)
                if spec.merge.enabled and not remote:
                    exported = export_stages(spec, plan, trained["adapter_dir"], _card_facts(summary))
            if remote:  # the GPUs are free again: merge and GGUF run on the pools.export pool meanwhile
                exported = export_on_pool(spec, plan, trained["adapter_dir"], _card_facts(summary))
            if spec.merge.enabled:
                if "prompts" in exported:
                    summary["evaluation"]["prompts"] = exported.pop("prompts")
                summary.update(exported)
    finally:
        registry.release_all()  # also on failure: a failed run must not pin a model in this process
        records = load_records(spec.run_dir() / "memory")
        publish_memory_report(records)
        publish_memory_chart(records, spec.name)
    summary["memory"] = [asdict(r) for r in records]
    summary["report"] = str(write_run_report(spec.run_dir(), summary))
    finish_run(spec, began)
    return summary


def _card_facts(summary: dict) -> dict:
    """The training facts the model card needs (small, JSON-able)."""
    trained = summary["packed_sft"]
    train = {k: trained.get(k) for k in ("steps", "eval_loss_before", "eval_loss_after", "tokens_seen")}
    # the run's training time, not this call's: a re-run that resumes the finished checkpoint trains 0 s
    train["seconds"] = trained.get("training_seconds", trained.get("seconds"))
    # what training ran with, for the card's hyperparameters ("auto" and downshifts change the spec's batch)
    ran = {k: trained.get(k) for k in ("micro_batch_size", "gradient_accumulation_steps", "optimizer", "precision")}
    return {"spec": summary["spec"], "train": train, "trained_with": ran}
