"""Where a run's log lines go, and how its times read in them.

Free of transformers' Trainer on purpose: the flow module imports it, and every process that loads the flow
(a flow run, the worker's crash-hook process, `slimtune run`) would otherwise pay for the Trainer's imports
(peft, bitsandbytes: ~6 s on 2 cores) before it knows whether it trains.
"""

from __future__ import annotations

import logging

from slimtune.report.artifacts import in_run

_log = logging.getLogger("slimtune.train")
# Marks rank 0's progress lines on its output, wherever a launcher puts them in the line (Ray prefixes the worker).
PROGRESS_EVENT = "slimtune-progress "


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow or task run (its lines go to the API and the console), else ours."""
    if not in_run():
        return _log
    from prefect.logging import get_run_logger

    return get_run_logger()


def duration(seconds: float) -> str:
    """ "1h 5m", "2m 3s", "42s"."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h {seconds % 3600 // 60}m"
    if seconds >= 60:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds}s"
