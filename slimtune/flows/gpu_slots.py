"""GPU slots: a run holds one per GPU it uses, so that two runs never share a card.

Two layers: the Prefect server's global concurrency limit (runs of one server, across hosts) and lock
files under PREFECT_HOME (runs of this machine, whatever server they use): the kernel keeps a file lock
while its holder lives, stopped or not, and drops it when the holder dies.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import torch

log = logging.getLogger(__name__)

_GPU_LEASE_S = 60.0


def gpu_slot() -> str:
    """The name of this host's GPU slot: `SLIMTUNE_GPU_SLOT`, default "gpu".

    Global concurrency limits are server-wide; with several GPU hosts on one Prefect server, give each
    host's workers their own name (e.g. SLIMTUNE_GPU_SLOT=gpu-node7) and create one limit per host.
    """
    return os.environ.get("SLIMTUNE_GPU_SLOT", "gpu")


def _visible_gpus(gpus: int) -> int:
    """Slots for this machine's GPUs: one per GPU this process sees, at least `gpus`, at least 1."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, gpus, visible)


def ensure_gpu_limit(slot: str, gpus: int = 1) -> int:
    """Create the global concurrency limit `slot` when the server lacks it; check it can hold `gpus` slots.

    The limit counts GPUs, not runs: a new one gets a slot per GPU this process sees (at least `gpus`,
    at least 1; a worker started with CUDA_VISIBLE_DEVICES=0 makes a one-slot limit, as before). Without
    it Prefect's `concurrency(..., strict=False)` warns "Concurrency limits [...] do not exist" and does
    not wait, so two runs would share the GPU. A limit someone created is kept; one smaller than `gpus`
    would be refused by the server ("Slots requested is greater than the limit"), so it is named here
    with the fix. A create that races another run's create is fine. Returns the limit's slot count.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(slot).limit
        except ObjectNotFound:
            limit = _visible_gpus(gpus)
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=slot, limit=limit))
            except ObjectAlreadyExists:
                limit = client.read_global_concurrency_limit_by_name(slot).limit
    if limit < gpus:
        raise ValueError(
            f"train.num_gpus is {gpus} but the GPU concurrency limit {slot!r} has {limit} slot(s) (it counts "
            f"GPUs); raise it with `prefect gcl update {slot} --limit {gpus}` or lower train.num_gpus"
        )
    return limit


@contextmanager
def _host_gpu_slots(slot: str, gpus: int, limit: int) -> Iterator[None]:
    """Hold `gpus` of `limit` lock files for `slot` on this machine, waiting until that many are free.

    The server's lease alone lets a live run lose its slot: a holder stopped longer than the lease (SIGSTOP,
    Ctrl-Z, a VM freeze) renews nothing, the server revokes the lease and a second run took the card. A
    file lock is the holder-liveness check: the kernel keeps it while the holder process exists, stopped or
    not, and drops it when the process dies (no PID to reuse, no zombie to misread), so a stopped run keeps
    its GPUs here however long it pauses and a killed one frees them at once.
    """
    import fcntl

    from prefect.settings import PREFECT_HOME

    folder = Path(PREFECT_HOME.value()) / "slimtune"
    folder.mkdir(parents=True, exist_ok=True)
    warned = False
    while True:
        held: list[IO[str]] = []
        for i in range(limit):
            f = (folder / f"{slot}.slot{i}.lock").open("a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            held.append(f)
            if len(held) == gpus:
                break
        if len(held) == gpus:
            break
        for f in held:
            f.close()  # closing drops the lock: take all `gpus` at once or none, so two waiters cannot deadlock
        if not warned:
            log.warning("waiting for the GPU: other live runs on this machine hold the slots of %s (%s)", slot, folder)
            warned = True
        time.sleep(1.0)
    try:
        yield
    finally:
        for f in held:
            f.close()


@contextmanager
def gpu_concurrency(slot: str = "gpu", gpus: int = 1) -> Iterator[None]:
    """Hold `gpus` slots (one per GPU the run uses) of the Prefect global concurrency limit `slot`.

    With a Prefect server (PREFECT_API_URL set) the limit is created when missing (`ensure_gpu_limit`), so
    two flow runs never share a GPU; a 2-GPU run waits until two slots are free, and it also holds `gpus` host
    lock files (`_host_gpu_slots`), so a live but paused holder whose lease the server revoked keeps the card.
    A run on a temporary server (`slimtune run` without PREFECT_API_URL) takes every host slot of the machine
    instead (the same lock files, so it also excludes a server's runs on this machine): that server keeps its
    leases in its own memory and revokes none, so a run killed outright (SIGKILL, the OOM killer) held its slot
    for good and the next run waited forever (seen: over 5 minutes, until killed); the kernel frees a file
    lock when its holder dies. Outside a Prefect run with no PREFECT_API_URL this is a no-op rather than
    starting a temporary server just to count slots.
    """
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        if FlowRunContext.get() is None and TaskRunContext.get() is None:
            yield
            return
        every = _visible_gpus(gpus)  # a temporary server counts nothing: hold the machine's GPUs, all of them
        with _host_gpu_slots(slot, every, every):
            yield
        return
    from prefect.concurrency.sync import concurrency

    limit = ensure_gpu_limit(slot, gpus)
    # The holder renews its lease while it runs; a run killed outright cannot release its slots, so the
    # lease is what frees them (the server's repossessor revokes it): 60 s rather than Prefect's default 300 s
    # keeps the re-submitted run (or the next queued one) from waiting five minutes on a dead process. The
    # host locks come first: a run waits there, not on the server, while a paused holder lives.
    with _host_gpu_slots(slot, gpus, limit), concurrency(slot, occupy=gpus, strict=False, lease_duration=_GPU_LEASE_S):
        yield
