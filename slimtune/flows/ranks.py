"""Where a stage runs: in the flow process (one GPU), on `torchrun` ranks (`train.num_gpus > 1`), or on Ray workers
(`train.cluster`, `flows.ray_train`).

This is the one place a run leaves the flow process, and the flow owns it (train/ knows nothing of tasks).
DDP needs one process per GPU, and the flow process must stay one process (Prefect's task runs, the
registry, the memory guard live there). So when `train.num_gpus > 1` the packed_sft task writes a job
file and runs `torchrun --standalone --nproc-per-node N -m slimtune.flows JOB`; every rank loads
its own NF4 copy onto its own GPU (device_map={"": local_rank}), attaches LoRA and trains, and
Trainer wraps the model in DistributedDataParallel so only the LoRA gradients are all-reduced. The
flow process loads no model for such a run: `deferred` is what its load_4bit and attach_lora tasks
report instead. Rank 0 alone writes checkpoints, the adapter and the reports (the trainer checks
`should_save`); the other ranks only compute.

`model.device: cpu` with `train.num_gpus: N` runs N CPU processes over gloo: the same code path,
used by the CPU tests.

Either launcher's output reaches the task's log line by line, and rank 0's progress lines (`ProgressEvents`)
drive the task's progress artifact and loss curve (`ProgressRelay`), as a run in the flow process does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from slimtune.core import atomic
from slimtune.report.run_log import PROGRESS_EVENT, run_logger
from slimtune.spec.schema import PipelineSpec

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
# Set in torchrun's rendezvous store by rank 0 once it has written the result (see `_leave_together`).
_DONE_KEY = "slimtune/rank0-done"
# Lines of the workers' output kept for the error message of a failed launch.
_TAIL_LINES = 40
# The ranks' own log lines (`main`'s and the Ray worker's format) go to the task's run log, as a one-GPU run's do;
# the launcher's (torchrun's, Ray's) to this module's logger. Ray colours its prefixes.
_RANK_LINE = "[rank "
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def run_stage(spec: PipelineSpec, stage: str, here: Callable[[], dict], **train_args: int | bool | str) -> dict:
    """The one branch on where training runs: `here()` in this process for one GPU; on the ranks otherwise.

    With several GPUs or a cluster, load_4bit and attach_lora are `deferred` (each rank does them itself) and
    packed_sft `launch`es the ranks (torchrun, or Ray for `train.cluster`) with `train_args` (micro_batch_size,
    gradient_accumulation_steps, gradient_checkpointing).
    """
    if spec.train.cluster is None and spec.train.num_gpus == 1:
        return here()
    if stage != "packed_sft":
        return deferred(stage, spec)
    if spec.train.cluster is not None:
        from slimtune.flows.ray_train import launch_on_ray  # Ray is imported only for a cluster run

        return launch_on_ray(spec, **train_args)
    return launch(spec, **train_args)


def deferred(stage: str, spec: PipelineSpec) -> dict:
    """What load_4bit / attach_lora report when the torchrun workers do that work inside packed_sft."""
    return {
        "handle": None,
        "checkpointing_handle": None,
        "deferred_to": "packed_sft",
        "reason": f"{_workers(spec)}: each of the {spec.train.world_size} {spec.train.parallelism.upper()} workers "
        f"runs {stage} on its own device; the flow process loads no model",
    }


def _workers(spec: PipelineSpec) -> str:
    cluster = spec.train.cluster
    if cluster is None:
        return f"train.num_gpus={spec.train.num_gpus}"
    return f"train.cluster: {cluster.num_workers} Ray workers at {cluster.address}"


def backend_of(spec: PipelineSpec) -> str:
    """The torch.distributed backend of the ranks: gloo for CPU workers, nccl for GPUs."""
    return "gloo" if spec.model.device == "cpu" else "nccl"


def check_devices(spec: PipelineSpec) -> str:
    """The torch.distributed backend for this spec: nccl on GPUs, gloo on the CPU; clear errors otherwise."""
    n = spec.train.num_gpus
    device = spec.model.device
    if device == "cpu" and spec.train.parallelism == "fsdp":
        # accelerate turns FSDP on only for GPU backends: on the CPU the ranks would silently run DDP.
        raise ValueError(
            f"train.parallelism fsdp with model.device cpu: FSDP runs on GPUs only (accelerate enables it for "
            f"GPU backends); use train.parallelism: ddp to run the {n} workers on the CPU"
        )
    if device == "cpu":
        return backend_of(spec)
    if device.startswith("cuda:"):
        raise ValueError(
            f"model.device {device!r} with train.num_gpus {n}: DDP uses GPUs 0..{n - 1} of "
            "CUDA_VISIBLE_DEVICES; set model.device: auto and pick the GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < n:
        raise ValueError(
            f"train.num_gpus is {n} but {visible} GPU(s) are visible; lower train.num_gpus, "
            "or set model.device: cpu to run the workers on the CPU (tests)"
        )
    return backend_of(spec)


def _worker_env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    # The device hosts require NVLink multicast (NVLS) off; NCCL otherwise tries it on H100/H200.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    # torchrun sets OMP_NUM_THREADS=1 when unset; on the CPU path that starves each rank, so split the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The workers are not Prefect task runs: their progress reaches the UI through this task's log.
    env.pop("PREFECT__FLOW_RUN_ID", None)
    return env


def launch(
    spec: PipelineSpec, *, micro_batch_size: int, gradient_accumulation_steps: int, gradient_checkpointing: bool | str
) -> dict:
    """Train with `spec.train.num_gpus` torchrun workers; returns rank 0's TrainReport dict plus world_size,
    backend, per-rank throughput (`ranks`) and `tokens_per_s_all_ranks`.

    The arguments are the packed_sft task's `TrainSettings` (`resolve_train`: possibly downshifted, per process,
    the checkpointing as a rank runs it); each rank trains with them as they are. A worker's
    out-of-memory error is re-raised here as `torch.OutOfMemoryError`, so that the memory guard retries
    the stage with a smaller micro-batch like a single-process run.
    """
    nproc = spec.train.num_gpus
    backend = check_devices(spec)
    run_dir = spec.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ddp-", dir=run_dir) as tmp:
        job_dir = Path(tmp)
        job = {
            "spec": spec.model_dump(mode="json"),
            "backend": backend,
            "micro_batch_size": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gradient_checkpointing": gradient_checkpointing,
        }
        (job_dir / "job.json").write_text(json.dumps(job), encoding="utf-8")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "slimtune.flows",
            str(job_dir),
        ]
        log.info("launching %d %s workers (%s): %s", nproc, spec.train.parallelism.upper(), backend, " ".join(cmd))
        returncode, tail = run_relayed(cmd, _worker_env(nproc), ProgressRelay(spec.name))
        result = job_dir / RESULT_FILE
        if returncode == 0 and result.is_file():
            return json.loads(result.read_text(encoding="utf-8"))
        raise_worker_error(job_dir, returncode, tail)
    raise AssertionError("unreachable")  # raise_worker_error always raises


class ProgressRelay:
    """Replays rank 0's progress lines (`ProgressEvents`) into this task's progress artifact and loss curve."""

    def __init__(self, run_name: str) -> None:
        # the Trainer's callbacks, imported by a run on several GPUs only: the flow module loads this one
        from slimtune.train.callbacks import stage_progress

        self.progress = stage_progress(run_name)

    def feed(self, line: str) -> bool:
        """Whether `line` was a progress line (replayed, not logged)."""
        at = line.find(PROGRESS_EVENT)
        if at < 0:
            return False
        try:
            event = json.loads(line[at + len(PROGRESS_EVENT) :])
        except ValueError:  # cut or interleaved by the launcher: the next line brings the figures again
            return False
        from transformers import TrainerControl, TrainerState

        state = TrainerState(
            global_step=event["step"], max_steps=event["max_steps"], log_history=event.get("history", [])
        )
        kind, progress = event["event"], self.progress
        if kind == "begin":
            progress.on_train_begin(None, state, TrainerControl())
        elif kind == "step":
            progress.on_step_end(None, state, TrainerControl(should_log=event["should_log"]))
        elif kind == "log":
            progress.on_log(None, state, TrainerControl(), logs=event["logs"])
        elif kind == "end":
            progress.on_train_end(None, state, TrainerControl())
        return True


def run_relayed(cmd: list[str], env: dict[str, str], relay: ProgressRelay) -> tuple[int, list[str]]:
    """Run a launcher (torchrun, the Ray driver), relaying its output to this task's log and its progress lines to
    `relay`; end the launcher's whole process group if this task is stopped. Returns the exit code and the last
    lines of output."""
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = _COLOUR.sub("", line.rstrip())
            if relay.feed(line):
                continue
            tail.append(line)
            (run_logger() if _RANK_LINE in line else log).info("%s", line)
        return proc.wait(), list(tail)
    finally:
        if proc.poll() is None:  # cancelled or crashed mid-training: no orphaned ranks holding GPUs
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def raise_worker_error(job_dir: Path, returncode: int, tail: list[str], launcher: str = "torchrun") -> None:
    """Raise the error of the rank that failed first: when one rank dies, the others fail next with gloo's or
    NCCL's "connection closed by peer", which says nothing of the cause."""
    errors = [json.loads(p.read_text(encoding="utf-8")) for p in job_dir.glob("error-rank*.json")]
    errors.sort(key=lambda e: (e.get("at", 0.0), e["rank"]))
    first = errors[0] if errors else None
    if first:
        others = ", ".join(f"rank {e['rank']}: {e['type']}" for e in errors[1:])
        who = f"rank {first['rank']}" if first["rank"] >= 0 else launcher  # -1: the launcher's own failure
        where = f"{who}: {first['type']}: {first['message']}" + (f" (then {others})" if others else "")
    else:  # killed without a word (a signal, the OOM killer): the launcher's own summary names the rank and signal
        where = "\n".join(tail[-15:])
    message = f"DDP training failed ({launcher} exit code {returncode}); {where}"
    if any(e["oom"] for e in errors):
        raise torch.OutOfMemoryError(message)
    raise RuntimeError(message)


def write_error(job_dir: Path, rank: int, error: BaseException) -> None:
    """Record why rank `rank` failed (`error-rank{rank}.json`) for `raise_worker_error`; rank -1 is the launcher."""
    from slimtune.memory.errors import classify

    atomic.write_json(
        job_dir / f"error-rank{rank}.json",
        {
            "rank": rank,
            "type": type(error).__name__,
            "message": str(error).strip()[:2000],
            "oom": classify(error),
            "at": time.time(),
            "traceback": "".join(traceback.format_exception(error))[-4000:],
        },
    )


def _rank_env() -> tuple[int, int, int]:
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def train_rank(job: dict, device_index: int, callbacks: list | None = None) -> dict:
    """Load, attach and train on this rank's device (GPU `device_index` under nccl); returns this rank's TrainReport
    as a dict. `callbacks`: Trainer callbacks beside `ProgressEvents` (Ray's checkpoint reports)."""
    from slimtune.memory.guard import guarded
    from slimtune.plan.run_plan import resolve_plan
    from slimtune.tasks.attach_lora import attach_lora
    from slimtune.tasks.load_4bit import load_4bit
    from slimtune.tasks.packed_sft import packed_sft, prepare_data
    from slimtune.train.callbacks import ProgressEvents

    spec = PipelineSpec.model_validate(job["spec"])
    if job["backend"] == "nccl":
        torch.cuda.set_device(device_index)
        spec.model.device = f"cuda:{device_index}"
    plan = resolve_plan(spec)  # once per rank: its own device, the flow's model folder (already resolved there)
    # Each rank runs under the spec's budget (the allocator cap, on this rank's GPU) and records its own peak:
    # the flow process's guard sees none of the ranks' allocations.
    guard = guarded("packed_sft", estimate=None, device=str(plan.torch_device), budget_fraction=_budget(spec))
    with guard as record:
        loaded = load_4bit(spec, plan)
        lora = attach_lora(spec, loaded.handle, plan)
        examples = prepare_data(spec, loaded.model_dir)
        report = packed_sft(
            spec,
            lora.handle,
            lora.checkpointing_handle,
            examples,
            micro_batch_size=job["micro_batch_size"],
            gradient_accumulation_steps=job["gradient_accumulation_steps"],
            gradient_checkpointing=job["gradient_checkpointing"],
            plan=plan,
            callbacks=[ProgressEvents(), *(callbacks or [])],
        )
    memory = {
        "budget": record.budget,
        "peak_gpu_allocated": record.peak_gpu_allocated,
        "peak_gpu_reserved": record.peak_gpu_reserved,
        "peak_host_rss": record.peak_host_rss,
    }
    return {**asdict(report), "memory": memory}


def gather_ranks(report: dict, rank: int, world: int, backend: str) -> dict:
    """Rank 0's report with every rank's throughput, losses and memory for the scaling report (a collective: every
    rank calls it; Trainer has set up the process group). `rank_losses`: this rank's share of each logged loss;
    the logged loss is their mean (see the trainer)."""
    import torch.distributed as dist

    mine = {
        "rank": rank,
        "tokens_per_s": report["tokens_per_s"],
        "tokens_seen": report["tokens_seen"],
        "losses": report["rank_losses"],
        "memory": report.pop("memory"),
    }
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    # flat keys: the run report renders them as rows of the packed_sft table
    return {
        **report,
        "world_size": world,
        "backend": backend,
        "ranks": ranks,
        "tokens_per_s_all_ranks": sum(r["tokens_per_s"] for r in ranks),
    }


def _budget(spec: PipelineSpec) -> float | None:
    return spec.guard.gpu_memory_fraction if spec.guard.enabled else None


def _leave_together(rank: int) -> None:
    """Keep the other ranks' connections open until rank 0 has finished its last collective.

    A rank that leaves right after the final all-gather closes its sockets while rank 0 may not have read that
    all-gather's data yet; gloo then fails rank 0 with "Connection closed by peer" (seen once in ~50 CPU runs).
    The rendezvous store torchrun serves outlives every rank, so the wait goes through it, not the process group.
    """
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if rank == 0:
        store.set(_DONE_KEY, "1")
    else:
        store.wait([_DONE_KEY])


def main(argv: list[str] | None = None) -> int:
    """Entry point of one torchrun worker: `python -m slimtune.flows JOB_DIR`."""
    import torch.distributed as dist

    job_dir = Path((argv or sys.argv[1:])[0])
    rank, local_rank, world = _rank_env()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    try:
        job = json.loads((job_dir / "job.json").read_text(encoding="utf-8"))
        report = gather_ranks(train_rank(job, local_rank), rank, world, job["backend"])
        if rank == 0:
            atomic.write_json(job_dir / RESULT_FILE, report)
        _leave_together(rank)
    except BaseException as e:
        write_error(job_dir, rank, e)
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0
