"""Training a LoRA adapter with transformers' Trainer, on packed rows, with atomic checkpoints and resume.

Trainer already does accumulation, schedules, mixed precision, RNG/optimizer/scheduler state, data
skipping on resume and `torch_empty_cache_steps`. What is added here: the packing collator, token and
padding accounting, checkpoints published atomically, resume only from complete checkpoints of the same
data and settings, and the adapter + report written atomically.

Resume across a memory-guard downshift works because Trainer's data position is the optimizer step: it
skips `step x accumulation` micro-batches of the new size, which is the same rows when micro-batch x
accumulation (the effective batch) is unchanged, and the loss is normalised by the target tokens of the
whole accumulation window (`num_items_in_batch`), not per micro-batch.

This module is the training run itself; beside it: `arguments` (Trainer's arguments), `resume` (the
fingerprint and which checkpoint to resume), `result` (the report) and `adapter_io` (writing the adapter).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.integrations import MLflowCallback, WandbCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from slimtune.core import atomic
from slimtune.data import TOKEN_COUNTS_KEY, Examples, RowCollator, RowDataset, one_per_row, pack, packing_efficiency
from slimtune.inference.evaluate import perplexity
from slimtune.report.run_log import run_logger
from slimtune.spec.schema import DataSpec, TrainSpec
from slimtune.train import checkpoints
from slimtune.train.adapter_io import add_expert_lora, save_adapter
from slimtune.train.arguments import ddp_bucket_cap_mb, training_arguments
from slimtune.train.callbacks import LogCallback, stage_progress
from slimtune.train.options import choose_batching, model_device, resolve_optimizer, resolve_precision
from slimtune.train.result import REPORT_FILE, TrainReport, read_report, run_identity
from slimtune.train.resume import (
    find_resume,
    fingerprint_of,
    is_finished,
    load_experts,
    nothing_left,
    restore_finished,
    training_settings,
)
from slimtune.train.step import StepSettings, step_context
from slimtune.train.step.attention import prefer_varlen
from slimtune.train.step.fp32_rope import keep_rope_fp32
from slimtune.train.terminal import TerminalBar
from slimtune.train.trackers import MLflowRun, WandbRun, offline_trackers

log = logging.getLogger(__name__)


class _Meter:
    """Real tokens and token slots of training micro-batches: since the last log line, and in all."""

    def __init__(self) -> None:
        self.tokens = self.slots = self.total_tokens = self.total_slots = 0
        self.since = time.perf_counter()

    def add(self, tokens: int, slots: int) -> None:
        self.tokens += tokens
        self.slots += slots
        self.total_tokens += tokens
        self.total_slots += slots

    def flush(self) -> tuple[int, int, float]:
        now = time.perf_counter()
        out = (self.tokens, self.slots, now - self.since)
        self.tokens = self.slots = 0
        self.since = now
        return out


class _SlimTrainer(Trainer):
    """Trainer with token accounting; `_PublishCheckpoint` publishes its checkpoints atomically.

    Only Trainer's public API is used for checkpoints (TrainingArguments.output_dir, the on_save callback,
    `train(resume_from_checkpoint=...)`): overriding its private `_save_checkpoint` / `_get_output_dir`
    tied resume to one transformers release's internals. Owning the training loop (as torchtune and litgpt
    do) was weighed and not taken: Trainer's accumulation, schedules, mixed precision, resume with data
    skipping and its trackers are what this module relies on; all would have to be re-written and re-tested.
    One private override remains, on the hot path: `_prepare_input`, for non-blocking copies of pinned
    batches (one of the changes behind benchmarks/results/h100/h100-2026-11-22-product.json, not measured alone);
    anything else falls back to Trainer's own.
    """

    def __init__(self, *args, checkpoint_state: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_state = checkpoint_state
        self.meter = _Meter()
        self._parameter_count: int | None = None  # see floating_point_ops
        # Training seconds before this call (from the resumed checkpoint) and when this call's training began,
        # so each checkpoint records the training time of the whole run, across resumes.
        self.seconds_before = 0.0
        self.began = time.perf_counter()
        # This rank's own loss since the last log line, kept on the device (no host sync per step).
        self._own_loss: torch.Tensor | None = None
        self._own_since = 0
        self.rank_losses: list[torch.Tensor] = []

    def training_seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.began

    def create_accelerator_and_postprocess(self) -> None:
        """The Accelerator, told not to move the model: load_4bit already placed every weight.

        accelerate's `prepare` otherwise calls `model.to(device)` (its 4-bit exemption needs attributes
        transformers 5 no longer sets), which pulled the `host_embedding` table back from pinned host
        memory onto the GPU: +0.98 GiB for the whole 8B run (measured). Batches are still moved by
        Trainer (`_prepare_inputs` sends them to `args.device`).
        """
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False

    def _prepare_input(self, data):
        # Pinned batches (dataloader_pin_memory) go to the GPU without blocking: Trainer's plain `.to(device)`
        # makes the host wait, once per micro-batch, until the GPU has finished everything queued before.
        if isinstance(data, torch.Tensor) and data.is_pinned() and self.args.device.type == "cuda":
            return data.to(self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    def floating_point_ops(self, inputs) -> int:
        # Trainer counts the model's parameters for this once per micro-batch, walking every module and
        # parameter (milliseconds of host time per step for an 8B model); the count does not change.
        if self._parameter_count is None:
            self._parameter_count = super().floating_point_ops({"input_ids": torch.empty(1)}) // 6
        ids = inputs.get("input_ids")
        return 6 * ids.numel() * self._parameter_count if ids is not None else 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.meter.add(*inputs.pop(TOKEN_COUNTS_KEY, (0, 0)))
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._own_loss = loss.detach() if self._own_loss is None else self._own_loss + loss.detach()
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(TOKEN_COUNTS_KEY, None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            if self._own_loss is not None:  # Trainer logs tr_loss / steps since its last log; the same here
                self.rank_losses.append(self._own_loss / max(self.state.global_step - self._own_since, 1))
            self._own_loss, self._own_since = None, self.state.global_step
            tokens, slots, seconds = self.meter.flush()
            if self.args.world_size > 1:  # every rank's tokens: the logged tokens/s is the run's, not rank 0's
                counts = torch.tensor([tokens, slots], dtype=torch.float64, device=self.args.device)
                torch.distributed.all_reduce(counts)  # one small collective per log line, as Trainer's loss gather
                tokens, slots = (int(c) for c in counts.tolist())
            before = next((e["tokens"] for e in reversed(self.state.log_history) if "tokens" in e), 0)
            logs.update(
                tokens=before + tokens,
                tokens_per_s=tokens / max(seconds, 1e-9),
                padding_waste=1 - tokens / max(slots, 1),
            )
        super().log(logs, start_time)


class _PublishCheckpoint(TrainerCallback):
    """Publishes each checkpoint Trainer just wrote: our state and the COMPLETE marker, then one rename.

    Trainer's output_dir is the staging folder (`checkpoints.STAGING`), so it writes `checkpoint-N` there,
    file by file, and then calls `on_save`; only here does the checkpoint reach `root`, where resume looks.
    """

    def __init__(self, trainer: _SlimTrainer, root: Path) -> None:
        self.trainer = trainer
        self.root = root

    def on_save(self, args, state, control, **kwargs) -> None:
        if args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank's files (its RNG state) are in before the rename
        if not args.should_save:  # under DDP rank 0 alone publishes
            return
        staged = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        add_expert_lora(staged, self.trainer.model)  # peft's save leaves an MoE's expert LoRA out
        seconds = self.trainer.training_seconds()
        ours = {**self.trainer.checkpoint_state, "step": state.global_step, "train_seconds": seconds}
        checkpoints.commit(staged, self.root, ours, keep=args.save_total_limit or 1)


class _EvalBefore(TrainerCallback):
    """Keeps the loss of the eval_on_start pass and restarts the tokens/s window after it."""

    def __init__(self, trainer: _SlimTrainer) -> None:
        self.trainer = trainer

    def on_evaluate(self, args, state, control, metrics=None, **kwargs) -> None:
        if state.global_step == 0 and metrics and "eval_loss" in metrics:
            self.trainer.checkpoint_state["eval_loss_before"] = metrics["eval_loss"]
            self.trainer.meter.flush()


def train_adapter(
    model,
    tokenizer,
    examples: Examples,
    train: TrainSpec,
    data: DataSpec,
    run_dir: Path,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    callbacks: list[TrainerCallback] | None = None,
    cuda_graphs: bool | None = None,
    stored_layers: int = 0,
    tracker_params: Mapping[str, str] | None = None,
    describe: Callable[[TrainReport], Sequence[Path]] | None = None,
) -> TrainReport:
    """Train the LoRA adapter of `model` on `examples`; resume from the latest complete checkpoint.

    Args:
        model: a peft PeftModel (LoRA attached, gradient checkpointing already configured).
        micro_batch_size: rows per forward pass (the memory guard may lower it on a retry).
        gradient_accumulation_steps: micro-batches per optimizer step (raised with a lower micro-batch).
        callbacks: extra Trainer callbacks (e.g. the memory guard's).
        cuda_graphs: capture each checkpointed layer's backward (`step_context`); default `train.cuda_graphs`.
        stored_layers: how many of the last checkpointed layers keep their activations (`step_context`).
        tracker_params: the spec as params for the trackers (`trackers.tracker_params`).
        describe: writes files about the finished adapter (its card) from the report, on rank 0 alone; MLflow and
            W&B get them and the report as artifacts.

    Returns:
        The report, also written to run_dir/train_report.json; the adapter is in run_dir/adapter.
    """
    start = time.perf_counter()
    run_dir = Path(run_dir)
    device = model_device(model)
    if data.packing != "padded":
        prefer_varlen(model, device)  # packed rows without a dense block mask where torch has varlen flash
    batching = choose_batching(model, data.packing)
    train_rows, eval_rows = _rows(examples, data, batching.mode)
    efficiency = packing_efficiency(train_rows, data.max_seq_length)
    precision = resolve_precision(train.precision, device)
    optim = resolve_optimizer(train.optimizer, device)
    ckpt_root = run_dir / "checkpoints"
    fsdp = train.sharded
    if fsdp:
        keep_rope_fp32(model)  # FSDP's mixed precision would cast RoPE's inv_freq buffer to bf16
    args = training_arguments(
        train,
        ckpt_root,
        micro_batch_size,
        gradient_accumulation_steps,
        precision,
        optim,
        device,
        has_eval=bool(eval_rows),
        bucket_cap_mb=ddp_bucket_cap_mb(model),
        fsdp=fsdp,
    )
    effective_batch = micro_batch_size * gradient_accumulation_steps * args.world_size
    settings = training_settings(train, data, effective_batch, batching.mode, model)
    fingerprint = fingerprint_of(examples, settings)
    previous = read_report(run_dir)
    with args.main_process_first(desc="checkpoint discovery"):  # rank 0 alone removes or moves old ones
        resume_from, eval_before, not_resumed = find_resume(
            ckpt_root,
            fingerprint,
            train.resume and not fsdp,
            settings,
            off="train.parallelism is fsdp (FSDP runs neither write nor resume checkpoints yet)" if fsdp else None,
        )
    if not not_resumed and nothing_left(resume_from, previous, run_dir):
        # A same-name re-run of a finished spec: training is complete, so the results are the earlier run's.
        report = TrainReport(**previous)
        report.reused_from = previous.get("reused_from") or previous.get("run_id") or previous.get("finished_at")
        report.resumed_from, report.seconds = str(resume_from), time.perf_counter() - start
        report.run_id, report.finished_at = run_identity()
        if args.process_index == 0:
            atomic.write_json(run_dir / REPORT_FILE, asdict(report))
            if describe is not None:
                describe(report)
        run_logger().info("nothing left to train: reusing the adapter and results of run %s", report.reused_from)
        return report
    seconds_before = checkpoints.read_state(resume_from).get("train_seconds", 0.0) if resume_from else 0.0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collator = RowCollator(
        batching.mode,
        pad_id if pad_id is not None else 0,
        flash_varlen=batching.flash_varlen,
        pad_to_multiple_of=8 if device.type == "cuda" else None,
        packed_length=data.max_seq_length if device.type == "cuda" else None,
    )
    # Trainer reads the trackers' settings when it is built (TensorBoard) and when training starts (MLflow).
    with offline_trackers(train.report_to, run_dir):
        trainer = _SlimTrainer(
            model=model,
            args=args,
            train_dataset=RowDataset(train_rows),
            eval_dataset=RowDataset(eval_rows) if eval_rows else None,
            data_collator=collator,
            callbacks=[
                LogCallback(),
                stage_progress(run_dir.name),
            ],
            checkpoint_state={
                "fingerprint": fingerprint,
                "settings": settings,
                "eval_loss_before": None,
                "micro_batch_size": micro_batch_size,
                "gradient_accumulation_steps": gradient_accumulation_steps,
            },
        )
        # Trainer's bar printed every log as a raw dict beside our step line: one bar of ours instead (a terminal)
        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(bar := TerminalBar())
        trackers: list[MLflowRun | WandbRun] = []  # Trainer's MLflow callback ends its run before the final eval
        if "mlflow" in train.report_to:
            trainer.remove_callback(MLflowCallback)
            trackers.append(MLflowRun(tracker_params or {}, run_dir / "mlflow-artifacts"))
        if "wandb" in train.report_to:
            trainer.remove_callback(WandbCallback)
            trackers.append(WandbRun(tracker_params or {}))
        for tracker in trackers:
            trainer.add_callback(tracker)
        # The eval before training runs inside train() (eval_on_start), after DDP has wrapped the model: an
        # evaluate() before train() marks the model prepared, and accelerate then skips the DDP wrap (ranks
        # silently diverge: verified with 2 gloo ranks, transformers 5.23 + accelerate).
        trainer.args.eval_on_start = resume_from is None and bool(eval_rows)
        trainer.add_callback(_EvalBefore(trainer))
        trainer.add_callback(_PublishCheckpoint(trainer, ckpt_root))
        for callback in callbacks or []:  # after the publishing: their on_save finds the checkpoint in place
            trainer.add_callback(callback)
        began = trainer.began = time.perf_counter()
        trainer.seconds_before = seconds_before
        graphs_note, stored = None, 0
        if resume_from is not None and is_finished(resume_from):
            restore_finished(trainer, model, resume_from)
        else:
            step_settings = StepSettings(
                single_process=args.world_size == 1,
                cuda_graphs=train.cuda_graphs if cuda_graphs is None else cuda_graphs,
                stored_layers=stored_layers,
            )
            try:
                # the bar closes also when training fails: the console gets its handlers back
                if resume_from is not None:
                    load_experts(model, resume_from)  # Trainer's resume loads peft's layers only
                with contextlib.closing(bar), step_context(model, step_settings) as step:
                    stored = step.stored
                    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
                    if (graphs := step.graphs) is not None:
                        graphs_note = f"{graphs.captured} captured, {graphs.replays} replays"
                        graphs_note += f"; off after a failed capture: {graphs.reason}" if graphs.reason else ""
                        run_logger().info("CUDA graphs of the layers' backward: %s", graphs_note)
            except BaseException as e:
                if args.should_save:  # what a failed save left half-written never reaches ckpt_root
                    shutil.rmtree(ckpt_root / checkpoints.STAGING, ignore_errors=True)
                if not isinstance(e, Exception) or not checkpoints.is_disk_full(e):  # training's only large writes
                    raise
                raise OSError(errno.ENOSPC, checkpoints.write_failure(ckpt_root, model, e)) from e
            # Trainer lists its output folder (the staging one) on every rank at the end of train(): it goes only
            # once every rank is past that (rank 1 failed on a staging folder rank 0 had just removed)
            trainer.accelerator.wait_for_everyone()
            if args.should_save:
                shutil.rmtree(ckpt_root / checkpoints.STAGING, ignore_errors=True)
        train_seconds = time.perf_counter() - began
        eval_after = trainer.evaluate()["eval_loss"] if eval_rows else None
    eval_before = trainer.checkpoint_state["eval_loss_before"] if eval_before is None else eval_before
    training_seconds = trainer.training_seconds()
    last = checkpoints.latest_checkpoint(ckpt_root)
    last_state = checkpoints.read_state(last) if last is not None else {}
    if last_state.get("step") == trainer.state.global_step and "train_seconds" in last_state:
        # training ended on a checkpoint: report its time, so a re-run that resumes it reports the same
        training_seconds = last_state["train_seconds"]

    adapter_dir = run_dir / "adapter"
    # Under FSDP every rank holds a shard: all join the gather of the full state dict (rank 0 receives it).
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped) if fsdp else None
    if trainer.is_world_process_zero():  # under DDP/FSDP rank 0 alone writes the adapter and the report
        save_adapter(model, tokenizer, adapter_dir, state)
    history = trainer.state.log_history
    losses = [  # tokens/s per logged step (all ranks under DDP): the steady rate, without startup and evals
        {
            "step": e["step"],
            "loss": e["loss"],
            "learning_rate": e.get("learning_rate"),
            "tokens_per_s": e.get("tokens_per_s"),
        }
        for e in history
        if "loss" in e
    ]
    trained = [e for e in history if "tokens_per_s" in e]
    report = TrainReport(
        steps=trainer.state.global_step,
        losses=losses,
        eval_loss_before=eval_before,
        eval_loss_after=eval_after,
        tokens_seen=trained[-1]["tokens"] if trained else 0,
        tokens_per_s=trainer.meter.total_tokens / max(train_seconds, 1e-9),
        padding_waste=1 - trainer.meter.total_tokens / max(trainer.meter.total_slots, 1),
        packing_efficiency=efficiency,
        batching=batching.mode + (" (flash varlen)" if batching.flash_varlen else ""),
        batching_fallback=batching.fallback_reason,
        resumed_from=str(resume_from) if resume_from else None,
        not_resumed=not_resumed,
        seconds=time.perf_counter() - start,
        training_seconds=training_seconds,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        optimizer=optim,
        precision=precision,
        adapter_dir=str(adapter_dir),
        data=examples.summary(),
        rank_losses=[float(v) for v in torch.stack(trainer.rank_losses).tolist()] if trainer.rank_losses else [],
        perplexity_before=perplexity(eval_before),
        perplexity_after=perplexity(eval_after),
        cuda_graphs=graphs_note,
        stored_layers=stored,
    )
    report.run_id, report.finished_at = run_identity()
    described: list[Path] = []
    # Rank 0 alone writes the report and the adapter's card: a rank 1 that wrote the card raced rank 0's
    # save_adapter, which replaces the whole folder (seen in CI: rank 1's rename found its temporary file gone).
    if trainer.is_world_process_zero():
        atomic.write_json(run_dir / REPORT_FILE, asdict(report))
        described = list(describe(report)) if describe is not None else []
    for tracker in trackers:
        tracker.close([run_dir / REPORT_FILE, *described])
    trainer.accelerator.wait_for_everyone()  # no rank returns before the adapter exists
    log.info("trained %d steps in %.1f s: eval loss %s -> %s", report.steps, report.seconds, eval_before, eval_after)
    return report


def _rows(examples: Examples, data: DataSpec, mode: str) -> tuple[list, list]:
    if mode == "packed":
        return pack(examples.train, data.max_seq_length), pack(examples.eval, data.max_seq_length)
    return one_per_row(examples.train), one_per_row(examples.eval)
