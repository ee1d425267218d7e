"""The memory guard every stage runs under: preflight, budget, watch, classify, clean.

    with guarded("packed_sft", estimate=est, device="cuda:0", budget_fraction=0.9) as record:
        train(...)

A memory failure inside the block leaves as `MemoryPressure` (the original kept as `__cause__`),
which `retry_on_memory_pressure` retries with a downshift; any other error passes unchanged.
"""

from __future__ import annotations

import logging
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from slimtune.memory.clean import clean_memory
from slimtune.memory.device_usage import outside_allocator_bytes
from slimtune.memory.downshift import current_attempt
from slimtune.memory.errors import PreflightError, classify, memory_state, to_memory_pressure
from slimtune.memory.sampler import PeakSampler
from slimtune.memory.stage_estimate import Estimate

log = logging.getLogger(__name__)

_GIB = 1024**3
# bitsandbytes/accelerate place weights up to `max_memory`; the 10% kept back absorbs the
# quantisation transients and the CUDA context growth that loading triggers.
_LOAD_HEADROOM = 0.90


@dataclass
class GuardRecord:
    """What one guarded attempt of a stage needed and used; all sizes in bytes."""

    stage: str
    estimate: Estimate | None
    budget: int | None
    peak_gpu_allocated: int | None = None
    peak_gpu_reserved: int | None = None
    peak_device_used: int | None = None
    peak_host_rss: int = 0
    peak_host_anon: int = 0
    attempts: int = 1
    downshifts: list[str] = field(default_factory=list)
    seconds: float = 0.0
    outcome: str = "running"
    sampler_overhead: float = 0.0


def _free_disk(path: Path) -> int:
    # The output directory may not exist yet; its nearest existing parent is on the same disk.
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _shortfall(stage: str, resource: str, need: int, free: int, where: str, terms: str, field_: str) -> str:
    label = f"{stage}: " if stage else ""
    return (
        f"{label}not enough {resource}: the estimate is {need / _GIB:.2f} GiB ({terms}) but only "
        f"{free / _GIB:.2f} GiB is free {where}. Lower it with {field_}."
    )


def _tight(stage: str, need: int, free: int, where: str, allowance: int) -> str:
    label = f"{stage}: " if stage else ""
    return (
        f"{label}a tight fit: the estimate is {need / _GIB:.2f} GiB and {free / _GIB:.2f} GiB is free {where}; "
        f"{allowance / _GIB:.2f} GiB of the estimate allows for allocator fragmentation, so its tensors fit and it "
        "runs (running out of memory retries with a downshift)"
    )


def _gpu_checks(est: Estimate, dev: torch.device, budget_bytes: int | None) -> list[tuple[int, int, str]]:
    """(need, free, where) for the GPU: what the stage adds against what the device has free,
    and what the allocator will hold against the per-process budget.

    What this process already holds is counted once: the resident weights (when they are allocated
    here: a DDP parent has none) and the CUDA context (when it exists) are part of the estimate and
    are already missing from the device's free memory. Once CUDA is up, the estimate's calibrated context
    term gives way to what this process measurably holds outside the allocator (`outside_allocator_bytes`).
    """
    free, _total = torch.cuda.mem_get_info(dev)
    need, here = est.gpu_bytes, 0
    if torch.cuda.is_initialized():
        here = outside_allocator_bytes(dev)
        need += here - est.context_gpu_bytes
    if torch.cuda.memory_allocated(dev) >= 0.9 * est.resident_gpu_bytes:
        here += est.resident_gpu_bytes
    checks = [(max(need - here, 0), free, f"on {dev} (device free; {here / _GIB:.2f} GiB already here)")]
    if budget_bytes is not None:
        where = f"in the {budget_bytes / _GIB:.2f} GiB budget on {dev} (device-wide: context included)"
        checks.append((need, budget_bytes, where))
    return checks


def gpu_shortfalls(est: Estimate, dev: torch.device, budget_fraction: float | None) -> list[str]:
    """The GPU checks of `preflight` that `est` fails now, under a budget of `budget_fraction` of the device."""
    budget = None
    if budget_fraction is not None:
        budget = int(torch.cuda.get_device_properties(dev).total_memory * budget_fraction)
    return [where for need, free, where in _gpu_checks(est, dev, budget) if need > free]


def preflight(
    est: Estimate,
    *,
    device: str,
    disk_path: Path | None,
    budget_bytes: int | None = None,
    stage: str = "",
) -> None:
    """Fail before allocating when an estimate exceeds what is free.

    On a CPU device the GPU terms (weights, activations) live in host memory, so they are added to
    the host estimate. With `budget_bytes` the GPU check uses the smaller of the device's free
    memory and what is left of the budget.

    A GPU estimate over by no more than its allowance for allocator fragmentation (`Estimate.runs_in`) runs, with a
    warning: its tensors fit, and the capped allocator frees its cached blocks before it runs out. The
    estimate is never under what a run holds, so without this a card within that allowance of the run's need (1B at
    1 x 2048: estimated 2.43 GiB where it held 2.23-2.35) would be refused; running out still retries downshifted.

    Raises:
        PreflightError: naming the resource, the estimate, what is free, and the spec field to change.
    """
    dev = torch.device(device)
    gpu_field, host_field = est.fields.get("gpu"), est.fields.get("host")
    # (resource, need, free, where, largest terms, spec field)
    checks: list[tuple[str, int, int, str, str, str]] = []
    if dev.type == "cuda":
        for need, free, where in _gpu_checks(est, dev, budget_bytes):
            if need > free and est.runs_in(free, need):
                log.warning(_tight(stage, need, free, where, est.allowance()))
                continue
            checks.append(("GPU memory", need, free, where, est.top_terms("gpu: "), gpu_field or "the budget"))
        host_need, host_terms = est.host_bytes, est.top_terms("host: ")
    else:
        host_need = est.host_bytes + est.gpu_bytes - est.context_gpu_bytes  # no CUDA context on a CPU
        host_terms = ", ".join(t for t in (est.top_terms("gpu: "), est.top_terms("host: ")) if t)
        host_field = " or ".join(dict.fromkeys(f for f in (gpu_field, host_field) if f))
    available = psutil.virtual_memory().available
    checks.append(("host memory", host_need, available, "(psutil available)", host_terms, host_field or "host memory"))
    if disk_path is not None and est.disk_bytes > 0:
        checks.append(
            (
                "disk space",
                est.disk_bytes,
                _free_disk(Path(disk_path)),
                f"under {disk_path}",
                est.top_terms("disk: "),
                est.fields.get("disk", "the output directory"),
            )
        )
    problems = [_shortfall(stage, *check) for check in checks if check[1] > check[2]]
    if problems:
        raise PreflightError("\n".join(problems))


def max_memory_with_headroom(device: str) -> dict[int | str, int]:
    """`max_memory` for `from_pretrained`: free memory x 0.90 on the device and on the host."""
    dev = torch.device(device)
    limits: dict[int | str, int] = {"cpu": int(psutil.virtual_memory().available * _LOAD_HEADROOM)}
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        limits[dev.index if dev.index is not None else torch.cuda.current_device()] = int(free * _LOAD_HEADROOM)
    return limits


@contextmanager
def _budget(dev: torch.device, fraction: float | None) -> Iterator[int | None]:
    """Hold this process to `fraction` of the device, device-wide, restoring the old allocator cap after.

    A budget is a card size: the caching allocator is capped at the budget less what the process holds
    outside it (`outside_allocator_bytes`: the CUDA context, library handles, loaded kernels), so that
    "fits 6 GiB" means a 6 GiB card. Yields the device-wide budget in bytes.

    Raises:
        PreflightError: the budget does not even hold what CUDA keeps outside the allocator.
    """
    if fraction is None or dev.type != "cuda":
        yield None
        return
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory budget fraction is {fraction}; use a value in (0, 1]")
    if dev.index is None:  # "cuda" means the current device; the fraction API wants an index
        dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    budget, outside = int(total * fraction), outside_allocator_bytes(dev)
    if budget <= outside:
        raise PreflightError(
            f"guard.gpu_memory_fraction: {fraction:g} of {dev} is {budget / _GIB:.2f} GiB, no more than what "
            f"CUDA holds outside the allocator ({outside / _GIB:.2f} GiB); raise it"
        )
    previous = torch.cuda.get_per_process_memory_fraction(dev)
    torch.cuda.set_per_process_memory_fraction((budget - outside) / total, dev)
    try:
        yield budget
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, dev)


@contextmanager
def guarded(
    stage: str,
    *,
    estimate: Estimate | None,
    device: str,
    budget_fraction: float | None = None,
    disk_path: Path | None = None,
    sample_interval_s: float = 0.05,
    attempt: int | None = None,
    downshifts: list[str] | None = None,
    on_exit: Callable[[GuardRecord], None] | None = None,
) -> Iterator[GuardRecord]:
    """Run a stage under the memory guard and yield its `GuardRecord`.

    Args:
        stage: Name used in errors, logs and artifact keys.
        estimate: What the stage needs; checked by `preflight` before the body runs (None skips it).
        device: "cpu", "cuda" or "cuda:N".
        budget_fraction: Cap on this process's share of the GPU, so the stage fails inside its
            budget instead of starving other processes.
        disk_path: Where the stage writes, for the disk check.
        sample_interval_s: Sampler period; 50 ms costs well under 1% (see sampler.py).
        attempt: Attempt number for the record; defaults to Prefect's task run count (1 outside Prefect).
        downshifts: Notes of the downshifts applied to reach this attempt, copied into the record.
        on_exit: Called with the finished record, also when the body raised (e.g. publish a report).

    Raises:
        PreflightError: The estimate exceeds what is free; nothing was allocated.
        MemoryPressure: The body ran out of memory; the original error is its `__cause__`.
    """
    dev = torch.device(device)
    record = GuardRecord(
        stage=stage,
        estimate=estimate,
        budget=None,
        attempts=attempt if attempt is not None else current_attempt(),
        downshifts=list(downshifts or []),
    )
    started = time.perf_counter()
    clean_memory()
    try:
        with _budget(dev, budget_fraction) as budget:
            record.budget = budget
            if estimate is not None:
                preflight(estimate, device=device, disk_path=disk_path, budget_bytes=budget, stage=stage)
            sampler = PeakSampler(device, sample_interval_s)
            try:
                with sampler:
                    yield record
            finally:
                record.peak_gpu_allocated = sampler.peak_gpu_allocated
                record.peak_gpu_reserved = sampler.peak_gpu_reserved
                record.peak_device_used = sampler.peak_device_used
                record.peak_host_rss = sampler.peak_host_rss
                record.peak_host_anon = sampler.peak_host_anon
                record.sampler_overhead = sampler.overhead
        record.outcome = "completed"
    except PreflightError:
        record.outcome = "preflight failed"
        raise
    except BaseException as exc:
        if not classify(exc):
            record.outcome = f"failed: {type(exc).__name__}"
            raise
        record.outcome = "out of memory"
        # Snapshot before cleaning, so the error shows the pressure and not the recovered state.
        pressure = to_memory_pressure(exc, stage, memory_state(device))
        pressure.record = record
        # Finished frames of the traceback (forward, loss) still hold the body's tensors, and Prefect
        # keeps the exception in the failed state; clearing their locals lets the cleanup below
        # free them. The frame that entered this guard is still running, so
        # `retry_on_memory_pressure` clears it once the task has returned. Code lines stay.
        traceback.clear_frames(exc.__traceback__)
        if pressure is exc:
            raise
        raise pressure from exc
    finally:
        clean_memory()
        record.seconds = time.perf_counter() - started
        if on_exit is not None:
            on_exit(record)
