"""Training progress on a terminal: one bar (step, ETA, loss, tokens/s) instead of a line per step.

Trainer's own ProgressCallback printed each log as a raw dict under its bar, next to our step line
(`LogCallback`), so every step showed twice; the trainer drops it and adds `TerminalBar`. Where stderr
is a terminal the bar replaces the step lines on the console (they still reach the Prefect API, which
holds the run's log), and every other log line is written above the bar so the bar stays in one place.
Elsewhere (a file, a pipe, a worker) nothing changes: one log line per logging step.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TextIO

from tqdm import tqdm
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

# set on the step line's log record (`extra`), so the console can leave it to the bar
STEP_RECORD = "slimtune_step_line"


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (sys.stderr, sys.stdout)


class _AboveTheBar(logging.Handler):
    """Writes what a console handler would (its level, filters and formatter), above the bar; the step lines
    are left out, the bar shows them."""

    def __init__(self, console: logging.Handler, stream: TextIO):
        super().__init__(console.level)
        self.console, self.stream = console, stream
        self.filters = list(console.filters)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, STEP_RECORD, False):
            return
        try:
            tqdm.write(self.console.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class TerminalBar(TrainerCallback):
    """The bar, on rank 0, where `stream` (default stderr) is a terminal; does nothing elsewhere.

    `close` ends it and gives the console its handlers back; the trainer calls it also when training fails,
    which `on_train_end` would not see.
    """

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.bar: tqdm | None = None
        self._consoles = contextlib.ExitStack()
        self._loss: str = ""

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if not state.is_world_process_zero or not self.stream.isatty():
            return
        root = logging.getLogger()
        for console in [h for h in root.handlers if _is_console(h)]:
            above = _AboveTheBar(console, self.stream)
            root.removeHandler(console)
            root.addHandler(above)
            self._consoles.callback(root.addHandler, console)
            self._consoles.callback(root.removeHandler, above)
        self.bar = tqdm(
            total=state.max_steps,
            initial=state.global_step,  # a resumed run starts where its checkpoint was
            desc="training",
            unit="step",
            file=self.stream,
            dynamic_ncols=True,
        )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kwargs
    ) -> None:
        if self.bar is None or not logs or "loss" not in logs:
            return
        postfix = f"loss {logs['loss']:.4f}"
        if logs.get("tokens_per_s"):
            postfix += f", {logs['tokens_per_s']:,.0f} tok/s"
        self.bar.set_postfix_str(postfix)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self.close()

    def close(self) -> None:
        """End the bar and restore the console handlers (idempotent)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._consoles.close()
