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

import errno
import hashlib
import json
import logging
import shutil
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from slimtune import atomic
from slimtune.data import TOKEN_COUNTS_KEY, Examples, RowCollator, RowDataset, one_per_row, pack, packing_efficiency
from slimtune.evaluate import perplexity
from slimtune.spec import DataSpec, TrainSpec
from slimtune.train import checkpoints
from slimtune.train.callbacks import LogCallback, PrefectProgressCallback
from slimtune.train.options import choose_batching, model_device, resolve_optimizer, resolve_precision, scheduler_name

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
    "num_gpus",
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
    seconds: float
    micro_batch_size: int
    gradient_accumulation_steps: int
    optimizer: str
    precision: str
    adapter_dir: str
    data: dict = field(default_factory=dict)
    perplexity_before: float | None = None  # exp(eval loss): the held-out figure people compare across runs
    perplexity_after: float | None = None


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
    """Trainer with token accounting and checkpoints published atomically (see `checkpoints`)."""

    def __init__(self, *args, checkpoint_state: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_state = checkpoint_state
        self._staging: Path | None = None
        self.meter = _Meter()

    def create_accelerator_and_postprocess(self) -> None:
        """The Accelerator, told not to move the model: load_4bit already placed every weight.

        accelerate's `prepare` otherwise calls `model.to(device)` (its 4-bit exemption needs attributes
        transformers 5 no longer sets), which pulled the `host_embedding` table back from pinned host
        memory onto the GPU: +0.98 GiB for the whole 8B run (measured). Batches are still moved by
        Trainer (`_prepare_inputs` sends them to `args.device`).
        """
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False

    def _get_output_dir(self, trial) -> str:
        # While saving, Trainer writes (and rotates) inside the staging folder instead of the real one.
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        if not self.args.should_save:
            # Under DDP rank 0 alone writes checkpoints: the LoRA weights and optimizer state are identical
            # on every rank (all-reduced gradients); a second writer would race on the staging folder. The
            # other ranks still join store_flos, the one collective in Trainer._save_checkpoint (5.23).
            self.store_flos()
            return
        root = Path(self.args.output_dir)
        staging = root / checkpoints.STAGING
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
            staged = staging / f"checkpoint-{self.state.global_step}"
            checkpoints.commit(
                staged,
                root,
                {**self.checkpoint_state, "step": self.state.global_step},
                keep=self.args.save_total_limit or 1,
            )
        except Exception as e:
            if not checkpoints.is_disk_full(e):
                raise
            raise OSError(errno.ENOSPC, checkpoints.write_failure(root, model, e)) from e
        finally:
            self._staging = None
            shutil.rmtree(staging, ignore_errors=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.meter.add(*inputs.pop(TOKEN_COUNTS_KEY, (0, 0)))
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(TOKEN_COUNTS_KEY, None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            tokens, slots, seconds = self.meter.flush()
            before = next((e["tokens"] for e in reversed(self.state.log_history) if "tokens" in e), 0)
            logs.update(
                tokens=before + tokens,
                tokens_per_s=tokens / max(seconds, 1e-9),
                padding_waste=1 - tokens / max(slots, 1),
            )
        super().log(logs, start_time)


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
) -> TrainReport:
    """Train the LoRA adapter of `model` on `examples`; resume from the latest complete checkpoint.

    Args:
        model: a peft PeftModel (LoRA attached, gradient checkpointing already configured).
        micro_batch_size: rows per forward pass (the memory guard may lower it on a retry).
        gradient_accumulation_steps: micro-batches per optimizer step (raised with a lower micro-batch).
        callbacks: extra Trainer callbacks (e.g. the memory guard's).

    Returns:
        The report, also written to run_dir/train_report.json; the adapter is in run_dir/adapter.
    """
    start = time.perf_counter()
    run_dir = Path(run_dir)
    device = model_device(model)
    batching = choose_batching(model, data.packing)
    train_rows, eval_rows = _rows(examples, data, batching.mode)
    efficiency = packing_efficiency(train_rows, data.max_seq_length)
    precision = resolve_precision(train.precision, device)
    optim = resolve_optimizer(train.optimizer, device)
    ckpt_root = run_dir / "checkpoints"
    args = _arguments(
        train,
        ckpt_root,
        micro_batch_size,
        gradient_accumulation_steps,
        precision,
        optim,
        device,
        has_eval=bool(eval_rows),
    )
    fingerprint = _fingerprint(
        examples, train, data, micro_batch_size * gradient_accumulation_steps * args.world_size, batching.mode
    )
    with args.main_process_first(desc="checkpoint discovery"):  # rank 0 alone removes or moves old ones
        resume_from, eval_before = _find_resume(ckpt_root, fingerprint, train.resume)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collator = RowCollator(
        batching.mode,
        pad_id if pad_id is not None else 0,
        flash_varlen=batching.flash_varlen,
        pad_to_multiple_of=8 if device.type == "cuda" else None,
    )
    trainer = _SlimTrainer(
        model=model,
        args=args,
        train_dataset=RowDataset(train_rows),
        eval_dataset=RowDataset(eval_rows) if eval_rows else None,
        data_collator=collator,
        callbacks=[LogCallback(), PrefectProgressCallback(key=f"{run_dir.name}-training"), *(callbacks or [])],
        checkpoint_state={
            "fingerprint": fingerprint,
            "eval_loss_before": None,
            "micro_batch_size": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
        },
    )
    # The eval before training runs inside train() (eval_on_start), after DDP has wrapped the model: an
    # evaluate() before train() marks the model prepared, and accelerate then skips the DDP wrap (ranks
    # silently diverge: verified with 2 gloo ranks, transformers 5.23 + accelerate).
    trainer.args.eval_on_start = resume_from is None and bool(eval_rows)
    trainer.add_callback(_EvalBefore(trainer))
    began = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    eval_before = trainer.checkpoint_state["eval_loss_before"] if eval_before is None else eval_before
    train_seconds = time.perf_counter() - began
    eval_after = trainer.evaluate()["eval_loss"] if eval_rows else None

    adapter_dir = run_dir / "adapter"
    if trainer.is_world_process_zero():  # under DDP rank 0 alone writes the adapter and the report
        _save_adapter(model, tokenizer, adapter_dir)
    history = trainer.state.log_history
    losses = [
        {"step": e["step"], "loss": e["loss"], "learning_rate": e.get("learning_rate")} for e in history if "loss" in e
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
        seconds=time.perf_counter() - start,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        optimizer=optim,
        precision=precision,
        adapter_dir=str(adapter_dir),
        data=examples.summary(),
        perplexity_before=perplexity(eval_before),
        perplexity_after=perplexity(eval_after),
    )
    if trainer.is_world_process_zero():
        atomic.write_json(run_dir / REPORT_FILE, asdict(report))
    trainer.accelerator.wait_for_everyone()  # no rank returns before the adapter exists
    log.info("trained %d steps in %.1f s: eval loss %s -> %s", report.steps, report.seconds, eval_before, eval_after)
    return report


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
) -> TrainingArguments:
    evaluate = has_eval and train.eval_steps is not None
    return _OneDeviceArguments(
        train_device=str(device) if device.type == "cuda" else None,
        output_dir=str(output_dir),
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
        save_strategy="steps",
        save_steps=train.save_steps,
        save_total_limit=train.save_total_limit,
        torch_empty_cache_steps=train.empty_cache_steps,
        # activation_checkpointing stays at its default (off): the model's own setting (configured by
        # attach_lora, possibly the offloaded variant) must not be replaced by Trainer's.
        use_cpu=device.type == "cpu",
        report_to="none",
        ddp_find_unused_parameters=False,  # every LoRA weight is used every step
        remove_unused_columns=False,
        label_names=["labels"],
        dataloader_num_workers=0,
        include_num_input_tokens_seen="no",
    )


def _fingerprint(examples: Examples, train: TrainSpec, data: DataSpec, effective_batch: int, mode: str) -> str:
    """Identifies what a checkpoint's training depends on, so a changed spec or data never resumes it."""
    h = hashlib.sha256()
    settings = {
        "train": train.model_dump(exclude=_OPERATIONAL),
        "data": data.model_dump(),
        "effective_batch": effective_batch,
        "batching": mode,
    }
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for e in examples.train:
        h.update(array("q", e.input_ids).tobytes())
        h.update(array("q", e.labels).tobytes())
    return h.hexdigest()[:16]


def _find_resume(root: Path, fingerprint: str, resume: bool) -> tuple[Path | None, float | None]:
    """The checkpoint to resume from (and the eval loss measured before its training), or None."""
    checkpoints.remove_incomplete(root)
    latest = checkpoints.latest_checkpoint(root)
    if latest is None:
        return None, None
    state = checkpoints.read_state(latest)
    if resume and state.get("fingerprint") == fingerprint:
        log.info("resuming from %s (step %s)", latest, state.get("step"))
        return latest, state.get("eval_loss_before")
    why = "train.resume is false" if not resume else "the data or training settings changed since it was written"
    aside = root.with_name(f"{root.name}.previous")
    shutil.rmtree(aside, ignore_errors=True)
    root.rename(aside)
    log.warning("not resuming from %s (%s); moved the old checkpoints to %s", latest, why, aside)
    return None, None


def _save_adapter(model, tokenizer, final: Path) -> Path:
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    atomic.replace_dir(tmp, final)
    return final
