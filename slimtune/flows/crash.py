"""What a re-submitted run changes after the host killed the last one (OOM killer: SIGKILL, Crashed)."""

from __future__ import annotations

import copy

from slimtune.spec import PipelineSpec


def crash_downshift(parameters: dict) -> dict | None:
    """Flow parameters for the next attempt, or None when the spec's resubmit budget is spent.

    Halves the micro-batch and doubles accumulation (same effective batch) while it can, then switches to
    offloaded checkpointing; training resumes from the last complete checkpoint of the same run directory.
    """
    raw = parameters.get("spec")
    spec = PipelineSpec.model_validate(raw if raw is not None else {})
    if spec.resubmits >= spec.guard.max_crash_resubmits:
        return None
    data = copy.deepcopy(spec.model_dump(mode="json"))
    train = data["train"]
    if train["micro_batch_size"] > 1:
        train["micro_batch_size"] //= 2
        train["gradient_accumulation_steps"] *= 2
    else:
        data["lora"]["gradient_checkpointing"] = "unsloth"
    train["resume"] = True
    data["resubmits"] = spec.resubmits + 1
    return {**parameters, "spec": data}
