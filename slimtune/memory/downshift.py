"""Retry ladders: what a stage changes on each attempt after running out of memory.

Prefect retries a task in the same process and hands it the same arguments, so each ladder is a
pure function of the original settings and the attempt number (`prefect.runtime.task_run.run_count`,
1 on the first try). The task calls the ladder at its start and runs with what it returns.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from slimtune.core.exception_chain import exception_chain
from slimtune.memory.errors import MemoryPressure
from slimtune.spec.schema import MERGE_MEMORY_USAGE_MAX

_MERGE_STEP = 0.1
_MERGE_FLOOR = 0.1


class DownshiftExhausted(RuntimeError):
    """Every downshift was tried; not a MemoryPressure, so Prefect stops retrying."""


@dataclass(frozen=True)
class TrainShift:
    """Training settings for one attempt; `notes` lists every downshift taken to reach them."""

    micro_batch: int
    grad_accum: int
    checkpointing: bool | str
    notes: tuple[str, ...]


@dataclass(frozen=True)
class MergeShift:
    """Merge settings for one attempt; `notes` lists every downshift taken to reach them."""

    maximum_memory_usage: float
    notes: tuple[str, ...]


def current_attempt() -> int:
    """Prefect's run count of the current task run: 1 on the first try, 1 outside a task run."""
    from prefect.runtime import task_run

    return max(int(task_run.run_count), 1)


def _smaller_divisor(n: int) -> int:
    # The largest divisor of n that is at most n // 2 keeps micro_batch x accumulation exact
    # (8 -> 4, 6 -> 3, 3 -> 1).
    return next(d for d in range(n // 2, 0, -1) if n % d == 0)


def next_train_shift(
    micro_batch: int, grad_accum: int, checkpointing: bool | str
) -> tuple[int, int, bool | str, str] | None:
    """The one downshift rule, used by the retry ladder and by the crash hook (flows/resubmit.py).

    Returns (micro_batch, grad_accum, checkpointing, note) one step down, or None when nothing is
    left. The micro-batch goes to its largest divisor <= half, so micro_batch x accumulation (the
    effective batch, part of the resume fingerprint) is unchanged; at 1, checkpointing is offloaded.
    """
    if micro_batch > 1:
        smaller = _smaller_divisor(micro_batch)
        factor = micro_batch // smaller
        note = (
            f"micro-batch {micro_batch} -> {smaller}, gradient accumulation {grad_accum} -> "
            f"{grad_accum * factor} (effective batch {micro_batch * grad_accum} unchanged)"
        )
        return smaller, grad_accum * factor, checkpointing, note
    if checkpointing != "unsloth":
        return micro_batch, grad_accum, "unsloth", f"gradient checkpointing {checkpointing!r} -> 'unsloth' (offloaded)"
    return None


def downshift_train(micro_batch: int, grad_accum: int, checkpointing: bool | str, attempt: int) -> TrainShift:
    """Settings for training attempt `attempt` (1 = as configured).

    Each retry halves the micro-batch and doubles gradient accumulation, keeping the effective
    batch unchanged, until the micro-batch is 1; the next retry offloads checkpointed activations
    to host memory ("unsloth"); after that the ladder is exhausted.

    Raises:
        DownshiftExhausted: With advice on what to change in the spec.
    """
    if micro_batch < 1 or grad_accum < 1 or attempt < 1:
        raise ValueError(f"micro_batch {micro_batch}, grad_accum {grad_accum} and attempt {attempt} must all be >= 1")
    notes: list[str] = []
    for step in range(2, attempt + 1):
        shift = next_train_shift(micro_batch, grad_accum, checkpointing)
        if shift is None:
            raise DownshiftExhausted(
                f"packed_sft ran out of memory at micro-batch 1 with offloaded ('unsloth') checkpointing "
                f"after {step - 1} attempts. Lower data.max_seq_length, lower lora.r or target fewer "
                "lora.target_modules, use an 8-bit optimizer, raise the memory budget, or use a GPU "
                "with more memory."
            )
        micro_batch, grad_accum, checkpointing, note = shift
        notes.append(f"attempt {step}: {note}")
    return TrainShift(micro_batch, grad_accum, checkpointing, tuple(notes))


def downshift_merge(maximum_memory_usage: float, attempt: int) -> MergeShift:
    """`maximum_memory_usage` for merge attempt `attempt`: 0.1 lower per retry, at least 0.1.

    A lower value keeps fewer layers resident and spills more to disk.

    Raises:
        DownshiftExhausted: Once 0.1 has been tried, with advice.
    """
    if not 0.0 < maximum_memory_usage <= MERGE_MEMORY_USAGE_MAX or attempt < 1:
        raise ValueError(
            f"merge.maximum_memory_usage is {maximum_memory_usage} (use (0, {MERGE_MEMORY_USAGE_MAX}]) and "
            f"attempt {attempt} (>= 1)"
        )
    notes: list[str] = []
    value = maximum_memory_usage
    for step in range(2, attempt + 1):
        if value <= _MERGE_FLOOR + 1e-9:
            raise DownshiftExhausted(
                f"dequant_merge ran out of memory at merge.maximum_memory_usage {value:.1f} after "
                f"{step - 1} attempts. Free memory used by other processes, lower merge.max_shard_size_gb, "
                "or merge on a machine with more memory."
            )
        lowered = round(max(value - _MERGE_STEP, _MERGE_FLOOR), 2)
        notes.append(f"attempt {step}: maximum_memory_usage {value:.2f} -> {lowered:.2f} (more spilled to disk)")
        value = lowered
    return MergeShift(value, tuple(notes))


def retry_on_memory_pressure(task: Any, task_run: Any, state: Any) -> bool:
    """`retry_condition_fn` for `@task`: retry only when the attempt failed with MemoryPressure.

    Prefect 3.8 passes a Failed state whose `result()` re-raises the task's exception;
    `raise_on_failure=False` hands it back instead. Before a retry, the locals of the failed
    attempt's frames are cleared: the task function's own frame (which holds the batch and the
    activations of the failed step) was still executing when the guard saw the error, and Prefect
    keeps the exception, and so those frames, alive for the whole flow run.
    """
    exc = state.result(raise_on_failure=False)
    if not isinstance(exc, MemoryPressure):
        return False
    for err in exception_chain(exc):
        traceback.clear_frames(err.__traceback__)
    return True
