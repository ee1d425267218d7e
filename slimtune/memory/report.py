"""Memory reports as Prefect artifacts: one table per task attempt, one markdown report per flow run.

Reporting never fails a stage: outside a Prefect run there is nowhere to attach an artifact, so
the functions log and return None.
"""

from __future__ import annotations

import logging
import re
from uuid import UUID

from slimtune.memory.guard import GuardRecord

_GIB = 1024**3
_log = logging.getLogger(__name__)


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / _GIB:.2f}"


def artifact_key(stage: str) -> str:
    """Prefect artifact keys allow lower-case letters, digits and dashes: "packed_sft" -> "memory-packed-sft"."""
    return "memory-" + re.sub(r"[^a-z0-9]+", "-", stage.lower()).strip("-")


def record_row(record: GuardRecord) -> dict[str, str | int]:
    """One report row; sizes in GiB."""
    est = record.estimate
    return {
        "stage": record.stage,
        "outcome": record.outcome,
        "attempts": record.attempts,
        "estimate GPU GiB": _gib(est.gpu_bytes if est else None),
        "estimate host GiB": _gib(est.host_bytes if est else None),
        "budget GiB": _gib(record.budget),
        "peak GPU allocated GiB": _gib(record.peak_gpu_allocated),
        "peak GPU reserved GiB": _gib(record.peak_gpu_reserved),
        "peak device used GiB": _gib(record.peak_device_used),
        "peak host RSS GiB": _gib(record.peak_host_rss),
        "seconds": f"{record.seconds:.1f}",
        "downshifts": "; ".join(record.downshifts) or "none",
    }


def render_markdown(records: list[GuardRecord]) -> str:
    """The flow's memory report: a table of every stage, then each downshift on its own line."""
    lines = ["# Memory report", ""]
    if not records:
        return "\n".join([*lines, "No guarded stages ran."])
    rows = [record_row(r) for r in records]
    # A column that reads n/a in every row (every GPU figure on a CPU run) only pushes the real ones off-screen.
    columns = [c for c in rows[0] if c != "downshifts" and any(row[c] != "n/a" for row in rows)]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    lines.extend("| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows)
    shifts = [(r.stage, note) for r in records for note in r.downshifts]
    lines += ["", "## Downshifts", ""]
    lines += [f"- {stage}: {note}" for stage, note in shifts] or ["None: every stage ran as configured."]
    return "\n".join(lines)


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
        table=[record_row(record)],
        key=artifact_key(record.stage),
        description=f"Memory of {record.stage}, attempt {record.attempts}: {record.outcome}",
    )


def publish_memory_report(records: list[GuardRecord]) -> UUID | None:
    """Publish the flow's markdown memory report keyed "memory-report"; None outside a run."""
    if not _in_run():
        _log.info("flow memory report not published: not inside a Prefect run")
        return None
    from prefect.artifacts import create_markdown_artifact

    return create_markdown_artifact(
        markdown=render_markdown(records),
        key="memory-report",
        description="Estimate, budget, peaks and downshifts of every stage",
    )
