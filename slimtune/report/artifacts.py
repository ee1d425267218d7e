"""One Prefect artifact per kind and flow run, updated in place: the progress, the loss curve, the memory chart.

Prefect 3.8's flow-run page lists every artifact row of the run, sorted by id (a random UUID), so each
re-published version of a keyed chart was one more card in no time order: a 30-step run left 16 loss-curve
and 7 memory-chart cards. Here the first publish of a key in a flow run creates the artifact and later ones
update that row (`PATCH /artifacts/{id}`); the server moves the key's collection along with it, so the
artifact pages and the flow-run page show one card with the latest content.

Publishing never fails the caller: an artifact is a view of the run, not part of its result.
"""

from __future__ import annotations

import logging
import re
from uuid import UUID

from slimtune.spec.schema import STAGES

log = logging.getLogger(__name__)
PROGRESS_KIND = "progress"


def artifact_key(name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only: "Tiny Run_1" -> "tiny-run-1"."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def run_key(run_name: str, kind: str) -> str:
    """The key of one kind of artifact of a run: ("tiny-smoke", "loss-curve") -> "tiny-smoke-loss-curve"."""
    return artifact_key(f"{run_name}-{kind}")


def progress_key(run_name: str) -> str:
    """The key of the run's progress artifact: "tiny-smoke" -> "tiny-smoke-progress"."""
    return run_key(run_name, PROGRESS_KIND)


def stage_title(stage: str) -> str:
    """ "stage 3 of 6: packed_sft"."""
    return f"stage {STAGES.index(stage) + 1} of {len(STAGES)}: {stage}"


def stage_span(stage: str) -> tuple[float, float]:
    """The percent of the run's progress bar at the start and at the end of `stage` (an equal share each)."""
    k = STAGES.index(stage)
    return 100.0 * k / len(STAGES), 100.0 * (k + 1) / len(STAGES)


def in_run() -> bool:
    """Whether this code runs inside a Prefect flow or task run (an artifact needs one to attach to)."""
    try:
        from prefect.context import FlowRunContext, TaskRunContext
    except ImportError:
        return False
    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


def _existing(key: str | None) -> UUID | None:
    """The id of this flow run's artifact under `key`, if an earlier publish made one (an unkeyed one has none)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.utilities.context import get_task_and_flow_run_ids

    flow_run_id = get_task_and_flow_run_ids()[1]
    if key is None or flow_run_id is None:
        return None
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            ),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
    return found[0].id if found else None


def _update(artifact_id: UUID, data: object, description: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    with get_client(sync_client=True) as client:
        client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description))


def publish_markdown(key: str | None, markdown: str, description: str) -> UUID | None:
    """Create this run's markdown artifact `key`, or replace its content; None outside a run or on failure."""
    if not in_run():
        return None
    try:
        artifact_id = _existing(key)
        if artifact_id is not None:
            _update(artifact_id, markdown, description)
            return artifact_id
        from prefect.artifacts import create_markdown_artifact

        return create_markdown_artifact(markdown, key=key, description=description)
    except Exception as e:
        log.warning("could not publish the %s artifact: %s", key, e)
        return None


def publish_progress(key: str | None, percent: float, description: str, artifact_id: UUID | None = None) -> UUID | None:
    """Create this run's progress artifact `key` or move it to `percent`; pass the id a previous call returned
    to save the lookup. None outside a run or on failure."""
    if not in_run():
        return None
    try:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        artifact_id = artifact_id or _existing(key)
        if artifact_id is None:
            return create_progress_artifact(progress=percent, key=key, description=description)
        update_progress_artifact(artifact_id, progress=percent, description=description)
        return artifact_id
    except Exception as e:
        log.warning("could not publish the %s artifact: %s", key, e)
        return None
