"""What a re-submitted run changes after the host killed the last one (OOM killer: SIGKILL, Crashed)."""

from __future__ import annotations

import copy

from slimtune.memory.downshift import next_train_shift
from slimtune.spec import PipelineSpec


def crash_downshift(parameters: dict) -> dict | None:
    """Flow parameters for the next attempt, or None when the spec's resubmit budget is spent.

    One step of the retry ladder's rule (`next_train_shift`), so the effective batch, and with it the
    resume fingerprint, is unchanged: training resumes from the last complete checkpoint of the same run
    directory. With nothing left to shift (micro-batch 1, offloaded) the run is re-submitted unchanged.
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
