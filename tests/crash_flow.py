"""A flow that is SIGKILLed on its first submission, as the host OOM killer would, for test_crash_resubmit.

Deployed from this directory by the test; the worker imports it in a fresh process.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from prefect import flow

from slimtune.flows.resubmit import resubmit_on_crash


def halve_micro_batch(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """The downshift the lead's flow uses, in miniature: half the micro-batch, twice the accumulation."""
    spec = dict(parameters["spec"])
    train = dict(spec["train"])
    if train["micro_batch_size"] <= 1:
        return None
    train["micro_batch_size"] //= 2
    train["gradient_accumulation_steps"] *= 2
    spec["train"] = train
    spec["resubmits"] = spec.get("resubmits", 0) + 1
    spec["resume"] = True
    return {**parameters, "spec": spec}


@flow(on_crashed=[resubmit_on_crash(halve_micro_batch, max_resubmits=2)])
def crash_once(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("resubmits", 0) == 0:
        # What the kernel's OOM killer does: no exception, no cleanup, no state report.
        os.kill(os.getpid(), signal.SIGKILL)
    return spec
