"""Where a run is: a start line per stage in the log and "stage k of 6" in the run's one progress artifact.

Load, merge and GGUF used to log nothing until "Finished"; now each stage announces itself with what it is
about to do, and the progress artifact (one per run, updated in place) moves to the stage. The bar spans
the whole run: stage k of n starts at (k - 1) / n, and training fills its stage's share step by step.

The progress card on the flow-run page shows its description one line per paragraph, each cut at the
card's width (about 40 characters in the three-column grid of a 1400-pixel window), so the text is short
paragraphs, never one long line.
"""

from __future__ import annotations

import time

from slimtune.plan.run_plan import RunPlan
from slimtune.report.artifacts import progress_key, publish_progress, stage_span, stage_title
from slimtune.report.run_log import duration, run_logger
from slimtune.spec.schema import PipelineSpec


def _detail(spec: PipelineSpec, plan: RunPlan, stage: str) -> str:
    """What the stage is about to do, in a few words."""
    if stage == "load_4bit":
        return f"{spec.model.name_or_path} in NF4 on {plan.device}"
    if stage == "attach_lora":
        targets = spec.lora.target_modules
        return f"LoRA r={spec.lora.r} on {targets if isinstance(targets, str) else ', '.join(targets)}"
    if stage == "packed_sft":
        length = f"{spec.train.max_steps} steps" if spec.train.max_steps else f"{spec.train.epochs:g} epochs"
        return f"{length} at learning rate {spec.train.learning_rate:g}, rows of {spec.data.max_seq_length} tokens"
    if stage == "cleanup":
        return "free the models, check memory is back to the baseline"
    if stage == "dequant_merge":
        dtype = "the base's dtype" if spec.merge.output_dtype == "auto" else spec.merge.output_dtype
        return f"merge the adapter into shards in {dtype} under {spec.run_dir() / 'merged'}"
    push = f", push to {spec.export.push.repo_id}" if spec.export.push else ""
    return f"GGUF {', '.join(spec.export.gguf) or 'none'}{push}"


def start_stage(spec: PipelineSpec, plan: RunPlan, stage: str) -> None:
    """Log "stage k of 6: <stage>: <what it does>" and move the run's progress artifact to the stage."""
    title, detail = stage_title(stage), _detail(spec, plan, stage)
    run_logger().info("%s: %s", title, detail)
    publish_progress(progress_key(spec.name), stage_span(stage)[0], f"{title}\n\n{detail}")


def finish_run(spec: PipelineSpec, began: float) -> None:
    """Fill the run's progress bar once every stage has finished."""
    text = f"finished in {duration(time.perf_counter() - began)}\n\nsee the run-report artifact"
    publish_progress(progress_key(spec.name), 100.0, text)
