"""What `slimtune run` prints: log lines without tracebacks, unless `--debug` asks for them, and without other
libraries' notices and warnings, unless `--verbose` asks for them."""

from __future__ import annotations

import logging
import os
import sys
import warnings


class _NoTraceback(logging.Filter):
    """Drops the traceback of a record, keeping its one-line message (the Prefect API handler, which runs
    before the console's, still sends the traceback to the UI)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def _one_line_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """An error in a finaliser (e.g. asyncio's transport `__del__` while a Ctrl-C unwinds the run) as one
    line instead of Python's "Exception ignored in ... Traceback" block."""
    exc = unraisable.exc_value
    logging.getLogger("slimtune").debug("ignored in %r: %s: %s", unraisable.object, type(exc).__name__, exc)


def hide_tracebacks() -> None:
    """Keep tracebacks off the console: the log handlers' (Prefect's console handler sits on the root logger)
    and the interpreter's report of errors in finalisers."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NoTraceback())
    sys.unraisablehook = _one_line_unraisable


class _NoServerNotices(logging.Filter):
    """Drops the INFO records of the bare "prefect" logger: the temporary server's start and stop notices
    ("Starting temporary server on ... See https://docs.prefect.io/..."). Run and task loggers are its
    children, whose records this filter never sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO


def quiet_start() -> None:
    """Keep `slimtune run`'s console to the run's own lines (`--verbose` skips this): no library FutureWarnings
    and DeprecationWarnings, no MLflow INFO lines (its store's table creation) and no Prefect server notices."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when MLflow is imported (by Trainer)
    prefect = logging.getLogger("prefect")
    if not any(isinstance(f, _NoServerNotices) for f in prefect.filters):
        prefect.addFilter(_NoServerNotices())
