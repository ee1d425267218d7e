"""Memory management: the guard every task runs under, estimates and downshifts (checkpointing and offloading
are part of the training step: `slimtune.train.step`)."""

from slimtune.memory.clean import clean_memory
from slimtune.memory.downshift import (
    DownshiftExhausted,
    MergeShift,
    TrainShift,
    current_attempt,
    downshift_merge,
    downshift_train,
    retry_on_memory_pressure,
)
from slimtune.memory.errors import MemoryPressure, PreflightError, classify
from slimtune.memory.estimate import (
    estimate_export,
    estimate_load_4bit,
    estimate_merge,
    estimate_train,
)
from slimtune.memory.guard import GuardRecord, guarded, max_memory_with_headroom, preflight
from slimtune.memory.stage_estimate import Estimate

__all__ = [
    "DownshiftExhausted",
    "Estimate",
    "GuardRecord",
    "MemoryPressure",
    "MergeShift",
    "PreflightError",
    "TrainShift",
    "classify",
    "clean_memory",
    "current_attempt",
    "downshift_merge",
    "downshift_train",
    "estimate_export",
    "estimate_load_4bit",
    "estimate_merge",
    "estimate_train",
    "guarded",
    "max_memory_with_headroom",
    "preflight",
    "retry_on_memory_pressure",
]
