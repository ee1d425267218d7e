"""Training a LoRA adapter with transformers' Trainer, on packed rows, with atomic checkpoints and resume.

Trainer already does accumulation, schedules, mixed precision, RNG/optimizer/scheduler state, data
skipping on resume and `torch_empty_cache_steps`. What is added here: the packing collator, token and
padding accounting, checkpoints published atomically, resume only from complete checkpoints of the same
data and settings, and the adapter + report written atomically.

Resume across a memory-guard downshift works because Trainer's data position is the optimizer step: it
skips `step x accumulation` micro-batches of the new size, which is the same rows when micro-batch x
accumulation (the effective batch) is unchanged, and the loss is normalised by the target tokens of the
whole accumulation window (`num_items_in_batch`), not per micro-batch.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field
from datetime import UTC
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.integrations import MLflowCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from slimtune import atomic
from slimtune.charts import LOSS_CURVE_KIND
from slimtune.data import TOKEN_COUNTS_KEY, Examples, RowCollator, RowDataset, one_per_row, pack, packing_efficiency
from slimtune.evaluate import perplexity
from slimtune.memory.checkpointing import graphed_backward, parameters_from_lists
from slimtune.run_artifacts import progress_key, run_key, stage_span, stage_title
from slimtune.spec import DataSpec, TrainSpec
from slimtune.train import checkpoints
from slimtune.train.attention import prefer_varlen
from slimtune.train.callbacks import LogCallback, PrefectProgressCallback, run_logger
from slimtune.train.fp32_rope import keep_rope_fp32
from slimtune.train.options import choose_batching, model_device, resolve_optimizer, resolve_precision, scheduler_name
from slimtune.train.terminal import TerminalBar
from slimtune.train.trackers import MLflowRun
from slimtune.train.walks import walks_from_lists

log = logging.getLogger(__name__)

REPORT_FILE = "train_report.json"
# TrainSpec fields that may change between a checkpoint and its resume without changing the result.
_OPERATIONAL = {
    "micro_batch_size",
    "effective_batch_size",
    "gradient_accumulation_steps",
    "resume",
    "empty_cache_steps",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "save_total_limit",
    "kernels",
    "cuda_graphs",
    "num_gpus",
    "report_to",
}


@dataclass
class TrainReport:
    """What training did; also written to run_dir/train_report.json."""

    steps: int
    losses: list[dict]
    eval_loss_before: float | None
    eval_loss_after: float | None
    tokens_seen: int
    tokens_per_s: float
    padding_waste: float
    packing_efficiency: float
    batching: str
    batching_fallback: str | None
    resumed_from: str | None
    not_resumed: str | None  # why existing checkpoints were not resumed (they were moved aside)
    seconds: float  # this call, data preparation and evals included
    training_seconds: float  # training time of the whole run: a resumed run adds to its checkpoint's
    micro_batch_size: int
    gradient_accumulation_steps: int
    optimizer: str
    precision: str
    adapter_dir: str
    data: dict = field(default_factory=dict)
    perplexity_before: float | None = None  # exp(eval loss): the held-out figure people compare across runs
    perplexity_after: float | None = None
    run_id: str | None = None  # the Prefect flow run that trained (None outside Prefect)
    finished_at: str | None = None  # UTC, ISO 8601
    reused_from: str | None = None  # run_id (or finished_at) of the run whose results a 0-step re-run reuses
    # This process's share of each logged loss: under DDP the logged loss is the mean of the ranks' shares
    # (each rank's summed token losses x world size / the whole step's target tokens); one process: = losses.
    rank_losses: list[float] = field(default_factory=list)
    # CUDA graphs of the layers' backward: "N captured, M replays", with why they went off if they did; None
    # where they were not used (train.cuda_graphs false, more than one process, or `graphs_refusal`'s reasons)
    cuda_graphs: str | None = None


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
    tracker_params: Mapping[str, str] | None = None,
    describe: Callable[[TrainReport], Sequence[Path]] | None = None,
) -> TrainReport:
    """Train the LoRA adapter of `model` on `examples`; resume from the latest complete checkpoint.

    Args:
        model: a peft PeftModel (LoRA attached, gradient checkpointing already configured).
        micro_batch_size: rows per forward pass (the memory guard may lower it on a retry).
        gradient_accumulation_steps: micro-batches per optimizer step (raised with a lower micro-batch).
        callbacks: extra Trainer callbacks (e.g. the memory guard's).
        cuda_graphs: capture each checkpointed layer's backward (`graphed_backward`); default `train.cuda_graphs`.
        tracker_params: the spec as params for the trackers (`trackers.tracker_params`).
        describe: writes files about the finished adapter (its card) from the report; MLflow gets them and the
            report as artifacts.

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
    args = _arguments(
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
    settings = _settings(train, data, effective_batch, batching.mode, model)
    fingerprint = _fingerprint(examples, settings)
    previous = _read_report(run_dir)
    with args.main_process_first(desc="checkpoint discovery"):  # rank 0 alone removes or moves old ones
        resume_from, eval_before, not_resumed = _find_resume(
            ckpt_root,
            fingerprint,
            train.resume and not fsdp,
            settings,
            off="train.parallelism is fsdp (FSDP runs neither write nor resume checkpoints yet)" if fsdp else None,
        )
    if not not_resumed and _nothing_left(resume_from, previous, run_dir):
        # A same-name re-run of a finished spec: training is complete, so the results are the earlier run's.
        report = TrainReport(**previous)
        report.reused_from = previous.get("reused_from") or previous.get("run_id") or previous.get("finished_at")
        report.resumed_from, report.seconds = str(resume_from), time.perf_counter() - start
        report.run_id, report.finished_at = _run_identity()
        if args.process_index == 0:
            atomic.write_json(run_dir / REPORT_FILE, asdict(report))
        run_logger().info("nothing left to train: reusing the adapter and results of run %s", report.reused_from)
        if describe is not None:
            describe(report)
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
    with _offline_trackers(train.report_to, run_dir):
        trainer = _SlimTrainer(
            model=model,
            args=args,
            train_dataset=RowDataset(train_rows),
            eval_dataset=RowDataset(eval_rows) if eval_rows else None,
            data_collator=collator,
            callbacks=[
                LogCallback(),
                PrefectProgressCallback(
                    key=progress_key(run_dir.name),
                    curve_key=run_key(run_dir.name, LOSS_CURVE_KIND),
                    title=stage_title("packed_sft"),
                    span=stage_span("packed_sft"),
                ),
                *(callbacks or []),
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
        mlflow_run = None
        if "mlflow" in train.report_to:  # Trainer's own callback would end the run before the final evaluation
            trainer.remove_callback(MLflowCallback)
            trainer.add_callback(mlflow_run := MLflowRun(tracker_params or {}, run_dir / "mlflow-artifacts"))
        # The eval before training runs inside train() (eval_on_start), after DDP has wrapped the model: an
        # evaluate() before train() marks the model prepared, and accelerate then skips the DDP wrap (ranks
        # silently diverge: verified with 2 gloo ranks, transformers 5.23 + accelerate).
        trainer.args.eval_on_start = resume_from is None and bool(eval_rows)
        trainer.add_callback(_EvalBefore(trainer))
        trainer.add_callback(_PublishCheckpoint(trainer, ckpt_root))
        began = trainer.began = time.perf_counter()
        trainer.seconds_before = seconds_before
        graphs, graphs_note = None, None
        if resume_from is not None and _finished(resume_from):
            _restore_finished(trainer, model, resume_from)
        else:
            # one process: Trainer's per-step walks of the model, and each checkpointed layer's walk for its
            # trainable parameters, from lists (DDP and FSDP wrap modules in train()); the layers' backward as
            # CUDA graphs (DDP reduces gradients from hooks on each parameter's accumulation, which a graph skips)
            walks = contextlib.ExitStack()
            walks.callback(bar.close)  # also when training fails: the console gets its handlers back
            if args.world_size == 1:
                walks.enter_context(walks_from_lists(model))
                walks.enter_context(parameters_from_lists(model))
                if train.cuda_graphs if cuda_graphs is None else cuda_graphs:
                    graphs = walks.enter_context(graphed_backward(model))
            try:
                with walks:
                    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
                    if graphs is not None:
                        graphs_note = f"{graphs.captured} captured, {graphs.replays} replays"
                        graphs_note += f"; off after a failed capture: {graphs.reason}" if graphs.reason else ""
                        run_logger().info("CUDA graphs of the layers' backward: %s", graphs_note)
            except Exception as e:
                if not checkpoints.is_disk_full(e):  # the checkpoints are training's only large writes
                    raise
                raise OSError(errno.ENOSPC, checkpoints.write_failure(ckpt_root, model, e)) from e
            finally:
                if args.should_save:  # what a failed save left half-written never reaches ckpt_root
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
        _save_adapter(model, tokenizer, adapter_dir, state)
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
    )
    report.run_id, report.finished_at = _run_identity()
    if trainer.is_world_process_zero():
        atomic.write_json(run_dir / REPORT_FILE, asdict(report))
    described = list(describe(report)) if describe is not None else []
    if mlflow_run is not None:
        mlflow_run.close([run_dir / REPORT_FILE, *described])
    trainer.accelerator.wait_for_everyone()  # no rank returns before the adapter exists
    log.info("trained %d steps in %.1f s: eval loss %s -> %s", report.steps, report.seconds, eval_before, eval_after)
    return report


@contextlib.contextmanager
def _offline_trackers(report_to: list[str], run_dir: Path) -> Iterator[None]:
    """Point the trackers Trainer reports to at the run directory, offline, unless the user's environment
    already configures them; restored afterwards. Trainer's integrations read only these variables:
    TensorBoard its `TENSORBOARD_LOGGING_DIR`, MLflow `MLFLOW_TRACKING_URI` (else ./mlruns in the cwd),
    W&B `WANDB_MODE`/`WANDB_DIR`."""
    wanted = {
        "tensorboard": {"TENSORBOARD_LOGGING_DIR": str(run_dir / "tensorboard")},
        # MLflow 3 refuses its file store by default (maintenance mode); SQLite is its local store now.
        "mlflow": {
            "MLFLOW_TRACKING_URI": f"sqlite:///{(run_dir / 'mlflow.db').resolve()}",
            "MLFLOW_EXPERIMENT_NAME": "slimtune",  # `MLflowRun` creates it with its artifacts in the run dir
        },
        "wandb": {"WANDB_MODE": "offline", "WANDB_DIR": str(run_dir)},
    }
    added = {k: v for name in report_to for k, v in wanted[name].items() if k not in os.environ}
    # mlflow.set_experiment (called by Trainer's setup) exports the experiment's id to the environment
    exported = [] if "MLFLOW_EXPERIMENT_ID" in os.environ else ["MLFLOW_EXPERIMENT_ID"]
    os.environ.update(added)
    try:
        yield
    finally:
        for key in [*added, *exported]:
            os.environ.pop(key, None)


def _read_report(run_dir: Path) -> dict:
    """The train report an earlier run left in `run_dir` (fields this version does not know are dropped)."""
    try:
        raw = json.loads((run_dir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    fields = TrainReport.__dataclass_fields__
    required = {k for k, f in fields.items() if f.default is MISSING and f.default_factory is MISSING}
    return {k: v for k, v in raw.items() if k in fields} if required <= set(raw) else {}


def _nothing_left(resume_from: Path | None, previous: dict, run_dir: Path) -> bool:
    """Whether the checkpoint to resume from is the end of training and the earlier run's adapter is there."""
    if resume_from is None or not previous or not (run_dir / "adapter" / "adapter_config.json").is_file():
        return False
    try:
        state = json.loads((resume_from / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    step = state.get("global_step", -1)
    return step >= state.get("max_steps", 0) > 0 and previous.get("steps") == step


def _run_identity() -> tuple[str | None, str]:
    """(the Prefect flow run id, or None outside Prefect; the UTC time now)."""
    from datetime import datetime

    from prefect.runtime import flow_run

    return flow_run.id, datetime.now(UTC).isoformat(timespec="seconds")


def _rows(examples: Examples, data: DataSpec, mode: str) -> tuple[list, list]:
    if mode == "packed":
        return pack(examples.train, data.max_seq_length), pack(examples.eval, data.max_seq_length)
    return one_per_row(examples.train), one_per_row(examples.eval)


@dataclass
class _OneDeviceArguments(TrainingArguments):
    """TrainingArguments for a process that trains on exactly one device: the model's.

    Outside torchrun, transformers counts every visible GPU in `n_gpu` and uses cuda:0. On a host with
    two GPUs that doubled each micro-batch (`train_batch_size` = micro x n_gpu, all on one GPU, since
    Trainer does not DataParallel a 4-bit model) and the loss (scaled by n_gpu for DataParallel), and
    a model on cuda:1 would get its batches on cuda:0. Under DDP each rank already has one GPU.
    """

    train_device: str | None = None  # the model's device; a string so the arguments stay serialisable

    @property
    def n_gpu(self) -> int:
        return min(super().n_gpu, 1)

    @property
    def place_model_on_device(self) -> bool:
        # The loader placed every weight (and `host_embedding` the input table in host memory): Trainer
        # must not `model.to(device)` it, as its own 4-bit exemption covers only bitsandbytes-loaded models.
        return False

    @property
    def device(self) -> torch.device:
        device = super().device
        if self.world_size > 1 or self.train_device is None or device.type != "cuda":
            return device
        mine = torch.device(self.train_device)
        if torch.cuda.current_device() != mine.index:
            torch.cuda.set_device(mine)  # transformers selected cuda:0; Triton launches on the current one
        return mine


# FSDP-QLoRA (train.parallelism: fsdp), as peft's and bitsandbytes' FSDP-QLoRA guides set it up: FSDP1 with
# flat parameters (use_orig_params false), every decoder layer and every LoRA layer its own unit (Trainer
# applies peft's wrap policy, and the 4-bit storage dtype as FSDP's mixed-precision dtype, when it sees a
# PeftModel). Not FSDP2: fully_shard turns bitsandbytes' Params4bit into plain Parameters and drops their
# quantization state (axolotl-ai-cloud/axolotl#2992). Every rank loaded the same weights and seeded the same
# LoRA init, so no broadcast of rank 0's (sync_module_states), which bitsandbytes' FSDP support does not cover
# (bitsandbytes#970). The adapter is gathered whole (FULL_STATE_DICT) for rank 0 to save.
_FSDP_QLORA = {
    "version": 1,
    "reshard_after_forward": "full_shard",
    "use_orig_params": False,
    "sync_module_states": False,
    "limit_all_gathers": True,
    "state_dict_type": "FULL_STATE_DICT",
}


def _arguments(
    train: TrainSpec,
    output_dir: Path,
    micro_batch_size: int,
    accumulation: int,
    precision: str,
    optim: str,
    device: torch.device,
    *,
    has_eval: bool,
    bucket_cap_mb: int,
    fsdp: bool = False,
) -> TrainingArguments:
    evaluate = has_eval and train.eval_steps is not None
    return _OneDeviceArguments(
        train_device=str(device) if device.type == "cuda" else None,
        output_dir=str(output_dir / checkpoints.STAGING),  # `_PublishCheckpoint` moves each one to output_dir
        per_device_train_batch_size=micro_batch_size,
        per_device_eval_batch_size=micro_batch_size,
        gradient_accumulation_steps=accumulation,
        learning_rate=train.learning_rate,
        lr_scheduler_type=scheduler_name(train.lr_scheduler),
        warmup_steps=train.warmup_steps,
        num_train_epochs=train.epochs,
        max_steps=train.max_steps if train.max_steps is not None else -1,
        optim=optim,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        seed=train.seed,
        data_seed=train.seed,
        logging_steps=train.logging_steps,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=train.eval_steps if evaluate else None,
        save_strategy="no" if fsdp else "steps",
        save_steps=train.save_steps,
        save_total_limit=train.save_total_limit,
        torch_empty_cache_steps=train.empty_cache_steps,
        # activation_checkpointing stays at its default (off): the model's own setting (configured by
        # attach_lora, possibly the offloaded variant) must not be replaced by Trainer's.
        use_cpu=device.type == "cpu",
        report_to=list(train.report_to) or "none",
        run_name=output_dir.parent.name,
        # DDP (ignored by a one-process run). Every LoRA weight is used every step, in the same order: no
        # search for unused parameters, and a static graph (DDP then also accepts the reentrant, offloaded
        # checkpointing, which re-runs each layer's forward inside backward). Trainer already skips the
        # all-reduce on the micro-batches before the last of an accumulation window (accelerator.no_sync).
        ddp_find_unused_parameters=False,
        ddp_static_graph=True,
        ddp_bucket_cap_mb=bucket_cap_mb,
        # The loss of a step is normalised by the target tokens of all ranks (gathered), and each rank's loss
        # is scaled by the world size, so the gradient mean and the logged mean across ranks are the global
        # token mean: the logged loss of N ranks equals one process's on the same rows (tests/test_ddp.py).
        average_tokens_across_devices=True,
        fsdp=fsdp,
        fsdp_config=_FSDP_QLORA if fsdp else None,
        remove_unused_columns=False,
        label_names=["labels"],
        dataloader_num_workers=0,
        include_num_input_tokens_seen="no",
        # Trainer's NaN/inf filter tests every micro-batch's loss on the host (a GPU sync per micro-batch);
        # a non-finite loss is logged as it is instead.
        logging_nan_inf_filter=False,
    )


def ddp_bucket_cap_mb(model: torch.nn.Module) -> int:
    """DDP's gradient bucket size for this model's trainable (LoRA) weights: about 8 buckets, 1-25 MB.

    DDP's default 25 MB buckets are sized for full fine-tuning (GBs of gradients). LoRA's are small (8B,
    r=16, all 7 projections: 42M fp32 values, 168 MB), so ~8 buckets let each all-reduce start while the
    backward of the earlier layers still runs; below 1 MB the per-collective launch cost dominates.
    """
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(1, min(25, round(grad_bytes / 8 / 2**20)))


def _canonical(value: object) -> object:
    """`value` with sets sorted and dicts' keys in order, so equal settings give equal JSON in every process.

    peft keeps `target_modules` as a set, whose iteration order depends on PYTHONHASHSEED.
    """
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float)) else str(value)


# peft config keys that do not change the trained weights (bookkeeping of the live model).
_PEFT_BOOKKEEPING = {"inference_mode", "runtime_config", "peft_version"}


def model_settings(model: torch.nn.Module) -> dict:
    """What the trained weights depend on that the model itself knows: its LoRA config and its quantization.

    Read from the live model rather than the spec, so that every adapter option (rank, alpha, dropout,
    targets, rslora, bias, trainable embeddings) and the base model's folder and 4-bit settings are covered
    however the model was built.
    """
    settings: dict = {}
    peft_config = getattr(model, "peft_config", {}).get("default")
    if peft_config is not None:
        lora = peft_config.to_dict()
        settings["lora"] = _canonical({k: v for k, v in lora.items() if k not in _PEFT_BOOKKEEPING})
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is not None:
        settings["quantization"] = _canonical(quant if isinstance(quant, dict) else quant.to_dict())
    base = getattr(getattr(model, "config", None), "_name_or_path", None)
    if base and (weights := _weights_key(Path(base))):
        settings["base_weights"] = weights
    return settings


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _weights_key(model_dir: Path) -> dict[str, list[int]]:
    """{file: [bytes, mtime in ns]} of every weight file of a local base model folder (empty for a Hub id).

    The folder's path alone let a re-run over weights overwritten in place (same config, another seed)
    report "nothing left to train" and merge the old adapter into the new base. Size and mtime are read
    in microseconds for any model size; a copy that does not keep mtimes (`cp` without -p) retrains once.
    """
    if not model_dir.is_dir():
        return {}
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name.endswith(".index.json"))
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def _settings(train: TrainSpec, data: DataSpec, effective_batch: int, mode: str, model: torch.nn.Module) -> dict:
    """Every setting a checkpoint's training depends on (the spec's operational fields left out)."""
    return _canonical(
        {
            "train": train.model_dump(exclude=_OPERATIONAL),
            "data": data.model_dump(),
            "effective_batch": effective_batch,
            "batching": mode,
            **model_settings(model),
        }
    )


def _fingerprint(examples: Examples, settings: dict) -> str:
    """Identifies what a checkpoint's training depends on, so a changed spec or data never resumes it."""
    h = hashlib.sha256()
    h.update(json.dumps(settings, sort_keys=True).encode())
    for e in examples.train:
        h.update(array("q", e.input_ids).tobytes())
        h.update(array("q", e.labels).tobytes())
    return h.hexdigest()[:16]


def _changed(old: dict | None, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between `old` and `new` (empty when `old` is unknown)."""
    if old is None:
        return []
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return out


def _find_resume(
    root: Path, fingerprint: str, resume: bool, settings: dict, off: str | None = None
) -> tuple[Path | None, float | None, str | None]:
    """The checkpoint to resume from, the eval loss measured before its training, and why not resumed."""
    checkpoints.remove_incomplete(root)
    latest = checkpoints.latest_checkpoint(root)
    if latest is None:
        return None, None, None
    state = checkpoints.read_state(latest)
    if resume and state.get("fingerprint") == fingerprint:
        log.info("resuming from %s (step %s)", latest, state.get("step"))
        return latest, state.get("eval_loss_before"), None
    if not resume:
        why = off or "train.resume is false"
    else:
        changed = _changed(state.get("settings"), settings)
        why = "changed since it was written: " + ("; ".join(changed) if changed else "the training data or settings")
    # Moved aside rather than refused: changing a setting and re-running under the same name is the
    # ordinary way to iterate, and the old checkpoints stay recoverable (one generation is kept).
    aside = root.with_name(f"{root.name}.previous")
    shutil.rmtree(aside, ignore_errors=True)
    root.rename(aside)
    message = f"not resuming from {latest} ({why}); training from scratch, old checkpoints moved to {aside}"
    log.warning(message)
    return None, None, message


def _finished(checkpoint: Path) -> bool:
    """True when `checkpoint` was written at the last step of its training."""
    state = json.loads((checkpoint / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    return 0 < state.get("max_steps", 0) <= state.get("global_step", 0)


def _restore_finished(trainer: Trainer, model, checkpoint: Path) -> None:
    """Load a finished checkpoint's adapter weights and trainer state instead of training.

    Trainer (transformers 5.23) resumed at the final step still trains one more step before it checks
    max_steps (measured: a re-run of a 4-step run reported 5 steps and published other weights), so a
    finished run is restored, not resumed.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
    trainer.state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE_NAME))
    log.info("%s is the finished checkpoint of this run: restored, nothing left to train", checkpoint)


def _canonical_adapter_config(path: Path) -> None:
    """Rewrite peft's adapter_config.json with sorted module lists: peft writes `target_modules` from a set,
    in an order that changes with PYTHONHASHSEED, so equal adapters gave different bytes and the merge's
    input hash never matched on a re-run."""
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("target_modules", "modules_to_save"):
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    atomic.write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_adapter(model, tokenizer, final: Path, state_dict: dict | None = None) -> Path:
    """Write the adapter atomically; `state_dict`: the gathered full state dict of a sharded (FSDP) model."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    _canonical_adapter_config(tmp / "adapter_config.json")
    _save_base_tokenizer(tokenizer, tmp)
    atomic.replace_dir(atomic.follow_umask(tmp), final)
    return final


def _save_base_tokenizer(tokenizer, out: Path) -> None:
    """The tokenizer's files as the base model has them, byte for byte (as the merge copies them).

    transformers 5.23's save_pretrained drops `legacy: true` from a Llama-2-style tokenizer_config.json, so
    the adapter's copy reloaded as legacy=False and tokenized text after a special token differently (seen:
    "<|im_start|>user" gave another id for "user"). Training never changes the tokenizer, so the files it
    was loaded from (`name_or_path`, the local model folder) are the right ones; save_pretrained still
    writes the names the folder lacks (e.g. chat_template.jinja where the base inlines it).
    """
    written = [Path(f) for f in tokenizer.save_pretrained(out)]
    base = Path(tokenizer.name_or_path)
    if not base.is_dir():  # not loaded from a folder (a tokenizer built in memory): what save_pretrained wrote
        return
    names = {f.name for f in written if f.parent == out} | set(tokenizer.vocab_files_names.values())
    for name in sorted(names):
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
