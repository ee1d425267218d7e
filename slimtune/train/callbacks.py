"""Trainer callbacks: a per-step log line and a Prefect progress artifact.

The terminal progress bar is the Trainer's own (tqdm); these add what it lacks: tokens, tokens/s and
padding waste in the log, and progress in the Prefect UI.
"""

from __future__ import annotations

import logging
import re

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger("slimtune.train")


class LogCallback(TrainerCallback):
    """One log line per logging step: loss, lr, tokens seen, tokens/s and padding waste."""

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kwargs
    ) -> None:
        logs = logs or {}
        if "loss" in logs:
            log.info(
                "step %d/%d loss %.4f lr %.3g tokens %d tok/s %.0f padding waste %.1f%%",
                state.global_step,
                state.max_steps,
                logs["loss"],
                logs.get("learning_rate", 0.0),
                logs.get("tokens", 0),
                logs.get("tokens_per_s", 0.0),
                100 * logs.get("padding_waste", 0.0),
            )
        elif "eval_loss" in logs:
            log.info("step %d/%d eval loss %.4f", state.global_step, state.max_steps, logs["eval_loss"])


class PrefectProgressCallback(TrainerCallback):
    """Shows training progress as a Prefect progress artifact; does nothing outside a Prefect run.

    Args:
        key: artifact key (lowercase letters, digits and dashes); None = an unkeyed artifact.
        updates: at most this many updates over the run (each is an API call; 100 = every 1%).
    """

    def __init__(self, key: str | None = None, updates: int = 100):
        self.key = re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-") if key else None
        self.updates = updates
        self.artifact_id = None
        self._last = -1.0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if not _in_prefect_run():
            return
        from prefect.artifacts import create_progress_artifact

        self._last = self._percent(state)
        self.artifact_id = create_progress_artifact(progress=self._last, key=self.key, description=_describe(state))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.artifact_id is None:
            return
        pct = self._percent(state)
        if pct - self._last >= 100 / self.updates or state.global_step >= state.max_steps:
            from prefect.artifacts import update_progress_artifact

            self._last = pct
            update_progress_artifact(self.artifact_id, progress=pct, description=_describe(state))

    @staticmethod
    def _percent(state: TrainerState) -> float:
        return 100.0 * state.global_step / max(1, state.max_steps)


def _describe(state: TrainerState) -> str:
    return f"training: step {state.global_step}/{state.max_steps}"


def _in_prefect_run() -> bool:
    try:
        from prefect.context import FlowRunContext, TaskRunContext
    except ImportError:
        return False
    return TaskRunContext.get() is not None or FlowRunContext.get() is not None
