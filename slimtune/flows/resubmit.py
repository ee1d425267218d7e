"""Turn a host OOM-kill of a flow run into a downshifted re-submission of its deployment.

When the kernel's OOM killer SIGKILLs the flow-run process, nothing inside it can react and
Prefect marks the run Crashed, which it never retries (PrefectHQ/prefect#10211). The worker (or
runner) that launched the process does run the flow's `on_crashed` hooks afterwards (prefect 3.8.8:
`FlowRunExecutor.submit` calls `run_crashed_hooks` when the process exits non-zero without
reporting an outcome), so the hook below re-submits the same deployment with downshifted
parameters, a bounded number of times. Resuming from the last checkpoint is the flow's job; the
`downshift` function keeps the resume setting on.

`crash_downshift`: what a re-submitted run changes after the host killed the last one (OOM killer: SIGKILL, Crashed).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from slimtune.memory.downshift import next_train_shift
from slimtune.spec.schema import PipelineSpec

_TAG_PREFIX = "resubmit-"
# The crash message carries the exit status ("Process exited with status code: -9. ...");
# -9 is SIGKILL seen by Python, 137 is SIGKILL reported through a shell.
_STATUS = re.compile(r"status code:?\s*(-?\d+)")
_KILLED = {-9, 137}
_TAG = re.compile(_TAG_PREFIX + r"(\d+)")


def _resubmits(tags: list[str]) -> int:
    return max((int(m.group(1)) for t in tags if (m := _TAG.fullmatch(t))), default=0)


def _killed(message: str | None) -> bool:
    # Without a parseable status the crash may still be an OOM kill; re-submitting is the safer bet.
    match = _STATUS.search(message or "")
    return match is None or int(match.group(1)) in _KILLED


def resubmit_on_crash(
    downshift: Callable[[dict[str, Any]], dict[str, Any] | None],
    max_resubmits: int = 2,
    *,
    only_killed: bool = True,
) -> Callable[..., None]:
    """Build an `on_crashed` hook that re-submits the crashed run's deployment, downshifted.

    Args:
        downshift: Maps the crashed run's parameters to the next run's (e.g. half the micro-batch,
            twice the accumulation, resume on), or None when nothing is left to try.
        max_resubmits: How many re-submissions one original run may cause; counted with a
            "resubmit-N" tag carried from run to run.
        only_killed: Re-submit only when the process was SIGKILLed (the OOM killer's signal).

    Returns:
        A hook `hook(flow, flow_run, state)` for `@flow(on_crashed=[...])`.
    """

    def resubmit_downshifted(flow: Any, flow_run: Any, state: Any) -> None:
        from prefect.logging.loggers import flow_run_logger

        # The flow-run logger sends these lines to the crashed run's log in the UI.
        logger = flow_run_logger(flow_run, flow)
        if flow_run.deployment_id is None:
            logger.warning("flow run %s crashed but has no deployment to re-submit", flow_run.name)
            return
        if only_killed and not _killed(state.message):
            logger.warning("flow run %s crashed without SIGKILL (%s); not re-submitting", flow_run.name, state.message)
            return
        done = _resubmits(list(flow_run.tags or []))
        if done >= max_resubmits:
            logger.error("flow run %s crashed after %d re-submissions; giving up", flow_run.name, done)
            return
        parameters = downshift(dict(flow_run.parameters or {}))
        if parameters is None:
            logger.error("flow run %s crashed and no downshift is left; giving up", flow_run.name)
            return
        from prefect.deployments import run_deployment

        tags = [t for t in (flow_run.tags or []) if not t.startswith(_TAG_PREFIX)] + [f"{_TAG_PREFIX}{done + 1}"]
        new_run = run_deployment(
            name=flow_run.deployment_id,
            parameters=parameters,
            tags=tags,
            timeout=0,
            as_subflow=False,
            # A hook that runs twice for one crash must not start two runs.
            idempotency_key=f"{flow_run.id}-resubmit",
        )
        logger.warning(
            "flow run %s was killed; re-submitted as %s (re-submission %d of %d)",
            flow_run.name,
            new_run.name,
            done + 1,
            max_resubmits,
        )

    return resubmit_downshifted


def crash_downshift(parameters: dict) -> dict | None:
    """Flow parameters for the next attempt, or None when the spec's resubmit budget is spent.

    One step of the retry ladder's rule (`next_train_shift`), so the effective batch, and with it the
    resume fingerprint, is unchanged: training resumes from the last complete checkpoint of the same run
    directory. With nothing left to shift (micro-batch 1, offloaded) the run is re-submitted unchanged. The retry
    ladder's last rung (`resolve_train`: drop stored layers and CUDA graphs) has no counterpart here: those hold
    GPU memory, and storing layers keeps their inputs off the host, so giving them up would not relieve the host.
    """
    raw = parameters.get("spec")
    spec = PipelineSpec.model_validate(raw if raw is not None else {})
    if spec.resubmits >= spec.guard.max_crash_resubmits:
        return None
    # Unset optional fields are left out: the deployment's parameter schema (the run form's) has no null
    # branch for them, and the server refuses a flow run whose parameters carry a None there.
    data = copy.deepcopy(spec.model_dump(mode="json", exclude_none=True))
    train = data["train"]
    # `auto` re-chooses from the estimate on the next run; only the checkpointing can shift under it.
    micro_batch = 1 if train["micro_batch_size"] == "auto" else train["micro_batch_size"]
    shift = next_train_shift(micro_batch, train["gradient_accumulation_steps"], data["lora"]["gradient_checkpointing"])
    if shift is not None:
        micro_batch, grad_accum, checkpointing, _note = shift
        if train["micro_batch_size"] != "auto":
            train.update(micro_batch_size=micro_batch, gradient_accumulation_steps=grad_accum)
        data["lora"]["gradient_checkpointing"] = checkpointing
    train["resume"] = True
    data["resubmits"] = spec.resubmits + 1
    return {**parameters, "spec": data}
