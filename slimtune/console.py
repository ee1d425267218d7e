"""What `slimtune run` prints: log lines without tracebacks, unless `--debug` asks for them."""

from __future__ import annotations

import logging


class _NoTraceback(logging.Filter):
    """Drops the traceback of a record, keeping its one-line message (the Prefect API handler, which runs
    before the console's, still sends the traceback to the UI)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def hide_tracebacks() -> None:
    """Keep tracebacks off the console handlers (Prefect's console handler sits on the root logger)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NoTraceback())
