"""Training on a Ray cluster (`train.cluster`): Ray Train's TorchTrainer gangs the ranks across machines.

A Prefect flow is not a gang scheduler: the nodes of one DDP/FSDP job must start together, restart together
when one dies, and find each other. Ray Train does that. The packed_sft task writes a job file and runs
`python -m slimtune.flows.ray_train JOB_DIR` (the driver) in a process of its own, as it runs torchrun for
`train.num_gpus`: the driver's output (Ray forwards every worker's) reaches the task's log line by line, rank
0's progress lines drive the task's progress artifact (`ranks.ProgressRelay`), and stopping the task (Ctrl-C,
cancelling in the UI, a crash) ends the driver, whose Ray job Ray then stops, workers included.

Each worker runs `ranks.train_rank` as a torchrun rank does (load NF4 on its GPU, attach LoRA, train); Ray has
set up the process group. Rank 0 writes the run's checkpoints as always and reports each to Ray
(`RayCheckpoints`), which keeps them under `train.cluster.storage_path`. When a worker or node dies Ray restarts
the worker group (`max_failures`); each new worker puts Ray's latest checkpoint into the run directory where it
is missing (a node that did not write it) and the trainer resumes from it, the data order included. A retry of
the task submits the job again under the same Ray run name, so Ray hands it the same checkpoints: the retry
resumes, it does not start over. The adapter comes back to this machine through Ray's storage.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback

from slimtune.core import atomic
from slimtune.flows import ranks
from slimtune.spec.schema import PipelineSpec
from slimtune.train import checkpoints

log = logging.getLogger(__name__)

# Set for the workers where this machine has them: Hub access for the model, our cache of built models, and
# NVLink multicast off (the device hosts require it; NCCL tries it on H100/H200 otherwise).
_FORWARDED_ENV = ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT", "SLIMTUNE_CACHE", "NCCL_NVLS_ENABLE")
_CHECKPOINT = re.compile(r"checkpoint-\d+")
_RESULT = "result"  # the last checkpoint Ray keeps: the adapter and rank 0's report, for the flow
_RETURNED = ("adapter", "train_report.json")  # what rank 0 sends back with the result


def launch_on_ray(
    spec: PipelineSpec, *, micro_batch_size: int, gradient_accumulation_steps: int, gradient_checkpointing: bool | str
) -> dict:
    """Train on `spec.train.cluster`'s Ray workers; returns rank 0's report with every rank's (as `ranks.launch`).

    A worker's out-of-memory error (after Ray's own restarts) is re-raised as `torch.OutOfMemoryError`, so that
    the memory guard retries the stage with a smaller micro-batch.
    """
    run_dir = spec.run_dir().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # the workers' working directory is not this process's (another machine's, or Ray's): absolute paths
    spec = spec.model_copy(deep=True)
    spec.output_dir = str(run_dir.parent)
    if Path(spec.model.name_or_path).is_dir():
        spec.model.name_or_path = str(Path(spec.model.name_or_path).resolve())
    with tempfile.TemporaryDirectory(prefix=".ray-", dir=run_dir) as tmp:
        job_dir = Path(tmp)
        job = {
            "spec": spec.model_dump(mode="json"),
            "backend": ranks.backend_of(spec),
            "micro_batch_size": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gradient_checkpointing": gradient_checkpointing,
        }
        atomic.write_json(job_dir / "job.json", job)
        cmd = [sys.executable, "-m", "slimtune.flows.ray_train", str(job_dir)]
        cluster = spec.train.cluster
        log.info("submitting %d Ray Train workers to %s: %s", cluster.num_workers, cluster.address, " ".join(cmd))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PREFECT__FLOW_RUN_ID", None)  # the driver is no Prefect run: its progress reaches the UI here
        returncode, tail = ranks.run_relayed(cmd, env, ranks.ProgressRelay(spec.name))
        result = job_dir / ranks.RESULT_FILE
        if returncode == 0 and result.is_file():
            return json.loads(result.read_text(encoding="utf-8"))
        ranks.raise_worker_error(job_dir, returncode, tail, launcher="Ray driver")
    raise AssertionError("unreachable")  # raise_worker_error always raises


def storage_path(spec: PipelineSpec) -> str:
    """Where Ray keeps the run's checkpoints: `train.cluster.storage_path`, else the run directory's ray/."""
    given = spec.train.cluster.storage_path
    return given if given else str((spec.run_dir() / "ray").resolve())


def _connect(spec: PipelineSpec) -> None:
    """Join the cluster, with the variables the workers need; a clear error where there is none to join."""
    import ray

    address = spec.train.cluster.address
    env_vars = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    env_vars.setdefault("NCCL_NVLS_ENABLE", "0")
    env_vars["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # the workers keep the working directory Ray starts them in
    try:
        ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
    except ConnectionError as e:
        raise ConnectionError(
            f"train.cluster.address {address}: no Ray cluster to join ({e}); start one with `ray start --head` "
            "on this machine or point the address at its head (host:port or ray://host:port)"
        ) from e


def _check_resources(spec: PipelineSpec) -> None:
    """Refuse a job the cluster cannot place now, which Ray would otherwise wait for without a word."""
    import ray

    cluster = spec.train.cluster
    kind, each = ("GPU", cluster.gpus_per_worker) if cluster.gpus_per_worker else ("CPU", 1)
    need, have = cluster.num_workers * each, ray.cluster_resources().get(kind, 0)
    if have < need:
        raise RuntimeError(
            f"train.cluster.num_workers {cluster.num_workers} needs {need:g} {kind}s; the Ray cluster at "
            f"{cluster.address} has {have:g}; add nodes or lower num_workers"
        )


def drive(job_dir: Path) -> None:
    """The driver: submit the job to Ray Train, wait for it, and put its result where the flow reads it."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    job = json.loads((job_dir / "job.json").read_text(encoding="utf-8"))
    spec = PipelineSpec.model_validate(job["spec"])
    cluster = spec.train.cluster
    _connect(spec)
    _check_resources(spec)
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"job": job},
        torch_config=TorchConfig(backend=job["backend"]),
        scaling_config=ScalingConfig(
            num_workers=cluster.num_workers,
            use_gpu=cluster.gpus_per_worker > 0,
            resources_per_worker={"GPU": cluster.gpus_per_worker} if cluster.gpus_per_worker else {"CPU": 1},
        ),
        run_config=RunConfig(
            # the run's name: a retry or a re-run of the task finds the same checkpoints in Ray's storage
            name=spec.name,
            storage_path=storage_path(spec),
            failure_config=FailureConfig(max_failures=cluster.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.train.save_total_limit + 1),
        ),
    )
    result = trainer.fit()
    with result.checkpoint.as_directory() as returned:
        returned = Path(returned)
        _place_adapter(returned, spec.run_dir())
        atomic.write_json(job_dir / ranks.RESULT_FILE, json.loads((returned / ranks.RESULT_FILE).read_text()))


def _place_adapter(returned: Path, run_dir: Path) -> None:
    """Put the adapter and report Ray returned into the run directory, unless rank 0 wrote these very files there
    (a run directory every node shares): a new run directory, or one holding an older run's adapter, gets them."""
    for name in _RETURNED:
        source, target = returned / name, run_dir / name
        if _same_files(source, target):
            continue
        staging = run_dir / f".{name}.ray-staging"
        shutil.rmtree(staging, ignore_errors=True)
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, staging)
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(staging, target)


def _same_files(a: Path, b: Path) -> bool:
    if a.is_file() or b.is_file():
        return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()
    if not b.is_dir():
        return False
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def _worker(config: dict) -> None:
    """One Ray Train worker: a rank of the run, as a torchrun worker is (`ranks.train_rank`)."""
    import ray.train
    import torch
    from ray.train.torch import get_device

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s", force=True)
    logging.getLogger("ray").setLevel(logging.WARNING)  # a line per report of each rank otherwise
    job = config["job"]
    spec = PipelineSpec.model_validate(job["spec"])
    root = spec.run_dir() / "checkpoints"
    if context.get_local_rank() == 0:  # one copy per node; the node's other ranks wait for it below
        restore_checkpoint(root, ray.train.get_checkpoint())
    torch.distributed.barrier()
    device = get_device()
    report = ranks.gather_ranks(
        ranks.train_rank(job, device.index or 0, callbacks=[RayCheckpoints(root)]), rank, world, job["backend"]
    )
    with tempfile.TemporaryDirectory() as tmp:  # rank 0's result travels to the flow through Ray's storage
        checkpoint = None
        if rank == 0:
            returned = Path(tmp)
            run_dir = spec.run_dir()
            for name in _RETURNED:
                (shutil.copytree if (run_dir / name).is_dir() else shutil.copyfile)(run_dir / name, returned / name)
            atomic.write_json(returned / ranks.RESULT_FILE, report)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        # every rank reports (a barrier): no rank leaves before rank 0's result is stored
        ray.train.report(
            {"step": report.get("steps", 0)}, checkpoint=checkpoint, checkpoint_dir_name=f"{_RESULT}-{time.time_ns()}"
        )


def restore_checkpoint(root: Path, checkpoint: object | None) -> Path | None:
    """Copy Ray's latest training checkpoint into `root` where it is missing (a node that did not write it, or a
    run directory that was cleared); the trainer's resume then finds it. Returns the copy, if one was made."""
    if checkpoint is None:
        return None
    name = Path(checkpoint.path).name
    if not _CHECKPOINT.fullmatch(name) or (root / name / checkpoints.COMPLETE).is_file():
        return None  # Ray's last is the result of a finished run, or the run directory has this checkpoint
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.ray-", dir=root))
    checkpoint.to_directory(str(staging))
    try:
        os.replace(staging, root / name)
    except OSError:  # another node's copy landed first (a run directory they share)
        shutil.rmtree(staging, ignore_errors=True)
        if not (root / name / checkpoints.COMPLETE).is_file():
            raise
    log.info("resuming from Ray's checkpoint %s (copied to %s)", checkpoint.path, root / name)
    return root / name


class RayCheckpoints(TrainerCallback):
    """Reports each checkpoint rank 0 publishes in `root` to Ray Train, which stores it for a restart after a worker
    dies. Every rank reports (Ray's report is a barrier); rank 0's carries the checkpoint. Runs after the trainer's
    own publishing (`trainer._PublishCheckpoint`), so the checkpoint is complete when Ray copies it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_save(self, args, state, control, **kwargs) -> None:
        import ray.train

        name = f"checkpoint-{state.global_step}"
        checkpoint = None
        if state.is_world_process_zero:
            checkpoint = ray.train.Checkpoint.from_directory(str(self.root / name))
        ray.train.report(
            {"step": state.global_step},
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            delete_local_checkpoint_after_upload=False,
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m slimtune.flows.ray_train JOB_DIR`: the Ray driver of one packed_sft task."""
    job_dir = Path((argv or sys.argv[1:])[0])
    logging.basicConfig(level=logging.INFO, format="[ray driver] %(name)s: %(message)s")
    try:
        drive(job_dir)
    except BaseException as e:
        _write_errors(job_dir, e)
        raise
    return 0


def _write_errors(job_dir: Path, error: BaseException) -> None:
    """The workers' errors as torchrun's ranks record theirs (`ranks.write_error`); a failure of the driver itself
    (no cluster, too few GPUs) as rank -1's."""
    for rank, failure in (getattr(error, "worker_failures", None) or {-1: error}).items():
        ranks.write_error(job_dir, rank, getattr(failure, "cause", None) or failure)  # RayTaskError wraps the cause


if __name__ == "__main__":
    sys.exit(main())
