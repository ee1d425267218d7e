"""Trainer callbacks: a per-step log line, the run's Prefect progress artifact and a live loss curve.

The terminal progress bar is the Trainer's own (tqdm); these add what it lacks: loss, learning rate,
tokens/s, padding waste and memory in the log (through Prefect's run logger inside a task, so the line
reaches the UI, the worker output and the CLI), and progress with ETA and a loss curve in the Prefect UI,
each one artifact per run updated in place (`slimtune.report.artifacts`).
"""

from __future__ import annotations

import json
import logging
import time

import psutil
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from slimtune.report.artifacts import (
    artifact_key,
    in_run,
    progress_key,
    publish_progress,
    run_key,
    stage_span,
    stage_title,
)
from slimtune.report.charts import LOSS_CURVE_KIND, loss_curve_png, publish_image
from slimtune.report.run_log import PROGRESS_EVENT, duration, run_logger
from slimtune.train.terminal import STEP_RECORD

log = logging.getLogger("slimtune.train")
_GIB = 1024**3


def memory_text() -> str:
    """Current host RSS and, on a GPU, the allocator's peak since the last reset, for the step log line."""
    text = f"host RSS {psutil.Process().memory_info().rss / _GIB:.2f} GiB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        text += f" GPU peak {torch.cuda.max_memory_allocated() / _GIB:.2f} GiB"
    return text


class LogCallback(TrainerCallback):
    """One log line per logging step: loss, lr, tokens seen, tokens/s, padding waste and memory."""

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kwargs
    ) -> None:
        logs = logs or {}
        if not state.is_world_process_zero:  # under DDP one line per step, not one per rank
            return
        if "loss" in logs:
            run_logger().info(
                "step %d/%d loss %.4f lr %.3g tokens %d tok/s %.0f padding waste %.1f%% %s",
                state.global_step,
                state.max_steps,
                logs["loss"],
                logs.get("learning_rate", 0.0),
                logs.get("tokens", 0),
                logs.get("tokens_per_s", 0.0),
                100 * logs.get("padding_waste", 0.0),
                memory_text(),
                extra={STEP_RECORD: True},  # on a terminal the bar shows it instead (`TerminalBar`)
            )
        elif "eval_loss" in logs:
            run_logger().info("step %d/%d eval loss %.4f", state.global_step, state.max_steps, logs["eval_loss"])


class PrefectProgressCallback(TrainerCallback):
    """Progress (step, ETA, loss, tokens/s) and a loss curve in the Prefect UI; does nothing outside a run.

    Args:
        key: the run's progress artifact key (made lowercase letters, digits and dashes); None = unkeyed.
        curve_key: loss-curve artifact key, likewise; None = unkeyed.
        updates: at most this many progress updates over training, evaluations aside (each is an API call;
            100 = every 1%).
        chart_every_s: re-draw the loss curve at most this often; each re-draw replaces the run's one loss-curve
            artifact (a PNG of ~23 KB, measured for 24 and 2,000 steps).
        title: the first line of the progress text (the flow passes "stage 3 of 6: packed_sft").
        span: the percent of the run's progress bar at the start and at the end of training.
    """

    def __init__(
        self,
        key: str | None = None,
        updates: int = 100,
        chart_every_s: float = 30.0,
        curve_key: str | None = None,
        title: str = "training",
        span: tuple[float, float] = (0.0, 100.0),
    ):
        self.key = artifact_key(key) if key else None
        self.curve_key = artifact_key(curve_key) if curve_key else None
        self.updates = updates
        self.chart_every_s = chart_every_s
        self.title = title
        self.span = span
        self.artifact_id = None
        self._last = -1.0
        self._began: float | None = None
        self._first_step = 0
        self._loss: float | None = None
        self._tokens_per_s: float | None = None
        self._train: list[tuple[int, float]] = []
        self._eval: list[tuple[int, float]] = []
        self._charted = 0.0
        self._due = False  # an update found due at a step's end, waiting for that step's log

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if not in_run():
            return
        self._began = None  # set at the first step's end: the eval before training is not a step's time
        self._first_step = state.global_step  # a resumed run's ETA counts only the steps it trains
        self._train = [(e["step"], e["loss"]) for e in state.log_history if "loss" in e]
        self._eval = [(e["step"], e["eval_loss"]) for e in state.log_history if "eval_loss" in e]
        self._last, self._due = self._percent(state), False
        self.artifact_id = publish_progress(
            self.key, self._run_percent(state), self.describe(state, time.perf_counter())
        )

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kwargs
    ) -> None:
        logs = logs or {}
        if "loss" in logs:
            self._loss, self._tokens_per_s = logs["loss"], logs.get("tokens_per_s")
            self._train.append((state.global_step, logs["loss"]))
        if "eval_loss" in logs:
            self._eval.append((state.global_step, logs["eval_loss"]))
        if self.artifact_id is None:
            return
        # An update the step's end found due waited for this log, which brings the step's figures; an eval
        # updates at once. Not every log: with `logging_steps: 1` that was an API call per training step.
        if self._due or "eval_loss" in logs:
            self._due = False
            self._update(state)
        # Evals are rare and the final one comes after on_train_end: each re-draws the curve at once.
        if "eval_loss" in logs or time.perf_counter() - self._charted >= self.chart_every_s:
            self.publish_curve()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.artifact_id is None:
            return
        if self._began is None:
            self._began, self._first_step = time.perf_counter(), state.global_step
        pct = self._percent(state)
        if pct - self._last >= 100 / self.updates or state.global_step >= state.max_steps:
            if control.should_log:  # Trainer logs this step after on_step_end: update with its figures then
                self._due = True
            else:
                self._update(state)

    def _update(self, state: TrainerState) -> None:
        self._last = self._percent(state)
        described = self.describe(state, time.perf_counter())
        self.artifact_id = publish_progress(self.key, self._run_percent(state), described, self.artifact_id) or (
            self.artifact_id  # a failed update (logged) keeps the artifact for the next one
        )

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.artifact_id is not None:
            if self._due:  # the last step's log never came
                self._due = False
                self._update(state)
            self.publish_curve()

    def publish_curve(self) -> None:
        """Re-draw the loss curve (train and eval so far) as the run's loss-curve artifact."""
        if not self._train and not self._eval:
            return
        self._charted = time.perf_counter()
        try:
            png = loss_curve_png(self._train, self._eval)
        except Exception as e:  # a broken plotting install must not stop training
            log.warning("could not draw the loss curve: %s", e)
            return
        publish_image(self.curve_key, "Loss curve", png, "Train and eval loss per optimizer step")

    def describe(self, state: TrainerState, now: float) -> str:
        """Short paragraphs, what is known so far (the flow-run page's card cuts each one at its width):

        stage 3 of 6: packed_sft

        step 15/30 · ETA 1m 20s

        loss 2.3140 · 4,210 tok/s
        """
        lines = [self.title]
        step = f"step {state.global_step}/{state.max_steps}"
        done = state.global_step - self._first_step
        if self._began is not None and done > 0:
            step += f" · ETA {duration((now - self._began) / done * (state.max_steps - state.global_step))}"
        lines.append(step)
        figures = [f"loss {self._loss:.4f}"] if self._loss is not None else []
        if self._tokens_per_s:
            figures.append(f"{self._tokens_per_s:,.0f} tok/s")
        if figures:
            lines.append(" · ".join(figures))
        return "\n\n".join(lines)

    @staticmethod
    def _percent(state: TrainerState) -> float:
        return 100.0 * state.global_step / max(1, state.max_steps)

    def _run_percent(self, state: TrainerState) -> float:
        """Training's percent placed in its share of the run's bar."""
        low, high = self.span
        return low + (high - low) * self._percent(state) / 100.0


def stage_progress(run_name: str) -> PrefectProgressCallback:
    """The packed_sft stage's progress artifact and loss curve of run `run_name` (the run directory's name)."""
    return PrefectProgressCallback(
        key=progress_key(run_name),
        curve_key=run_key(run_name, LOSS_CURVE_KIND),
        title=stage_title("packed_sft"),
        span=stage_span("packed_sft"),
    )


class ProgressEvents(TrainerCallback):
    """Rank 0's training progress as lines on stdout, for the flow process that launched the ranks (torchrun, Ray).

    The ranks are not Prefect task runs; the task that launched them reads these lines from their output and
    replays them into its own `stage_progress` callback (`flows.ranks.ProgressRelay`), so a run on several GPUs
    or machines shows the same progress artifact and loss curve as a run on one.
    """

    def _emit(self, state: TrainerState, event: str, **fields: object) -> None:
        if state.is_world_process_zero:
            line = {"event": event, "step": state.global_step, "max_steps": state.max_steps, **fields}
            print(PROGRESS_EVENT + json.dumps(line), flush=True)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        # what a resumed run has logged before: the curve starts from it
        history = [e for e in state.log_history if "loss" in e or "eval_loss" in e]
        self._emit(state, "begin", history=history)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self._emit(state, "step", should_log=bool(control.should_log))

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kwargs
    ) -> None:
        numbers = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        self._emit(state, "log", logs=numbers)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self._emit(state, "end")
