"""What `slimtune run` prints: log lines without tracebacks, unless `--debug` asks for them."""

from __future__ import annotations

import logging
import sys


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
