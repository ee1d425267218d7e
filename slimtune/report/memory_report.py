"""Memory reports as Prefect artifacts: one table per task attempt, one markdown report per flow run.

The rendering lives with the run report's (`slimtune.report.run_report`); this module publishes. Reporting never
fails a stage: outside a Prefect run there is nowhere to attach an artifact, so the functions log and
return None.
"""

from __future__ import annotations

import logging
import re
from uuid import UUID

from slimtune.memory.guard import GuardRecord
from slimtune.report.run_report import memory_row, render_memory_markdown

_log = logging.getLogger(__name__)


def artifact_key(stage: str) -> str:
    """Prefect artifact keys allow lower-case letters, digits and dashes: "packed_sft" -> "memory-packed-sft"."""
    return "memory-" + re.sub(r"[^a-z0-9]+", "-", stage.lower()).strip("-")


def _in_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def publish_task_report(record: GuardRecord) -> UUID | None:
    """Publish one attempt's record as a table artifact keyed "memory-<stage>"; None outside a run."""
    if not _in_run():
        _log.info("memory report for %s not published: not inside a Prefect run", record.stage)
        return None
    from prefect.artifacts import create_table_artifact

    return create_table_artifact(
        table=[memory_row(record)],
        key=artifact_key(record.stage),
        # the key names the stage; a card on the flow-run page shows one line of ~40 characters
        description=f"attempt {record.attempts}: {record.outcome}",
    )


def publish_memory_report(records: list[GuardRecord]) -> UUID | None:
    """Publish the flow's markdown memory report keyed "memory-report"; None outside a run."""
    if not _in_run():
        _log.info("flow memory report not published: not inside a Prefect run")
        return None
    from prefect.artifacts import create_markdown_artifact

    return create_markdown_artifact(
        markdown=render_memory_markdown(records),
        key="memory-report",
        description="Estimate, budget, peaks and downshifts of every stage",
    )
