"""Training on a Ray cluster (`train.cluster`): a local cluster of two Ray nodes started here, CPU workers on gloo.

The finetune flow runs with two Ray workers, one of which is killed mid-run: Ray restarts the worker group, which
resumes from the last checkpoint, and the run ends with the adapter of an uninterrupted 2-rank run (torchrun's);
its losses are a one-process run's with the same effective batch, its progress reaches the task's artifacts, its
adapter the flow's merge and GGUF. Stopping the driver (what cancelling the task does) stops the Ray job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from prefect_server import REPO
from safetensors.torch import load_file

from slimtune.core import registry
from slimtune.flows import ranks
from slimtune.spec.schema import ClusterSpec, PipelineSpec, SpecError, load_spec

pytest.importorskip("ray", reason="the ray extra (slimtune[ray]) is in requirements.lock")

_STEPS, _SAVE = 12, 4
# Ray names the worker processes after the actor class (setproctitle): what a kill or a leak check looks for.
_WORKER_TITLE = "RayTrainWorker"


@pytest.fixture(scope="module")
def ray_address():
    """Two Ray nodes on this machine, one CPU each: the two workers are placed one per node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def _spec(root: Path, name: str, address: str | None, workers: int = 2) -> PipelineSpec:
    spec = load_spec(REPO / "deployments" / "tiny-smoke.yaml")
    spec.output_dir = str(root)
    spec.name = name
    spec.lora.gradient_checkpointing = "unsloth"
    spec.train.max_steps, spec.train.save_steps = _STEPS, _SAVE
    spec.train.lr_scheduler = "constant"  # a step's learning rate is the same in a shorter reference run
    spec.train.micro_batch_size = 2
    if address is not None:
        spec.train.cluster = ClusterSpec(address=address, num_workers=workers, gpus_per_worker=0)
    return spec


def _batch(spec: PipelineSpec) -> dict:
    return {
        "micro_batch_size": spec.train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": spec.lora.gradient_checkpointing,
    }


def _workers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(_WORKER_TITLE in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> PipelineSpec:
    """The same training on 2 torchrun ranks (gloo), never interrupted: the adapter the Ray run must end with."""
    spec = _spec(tmp_path_factory.mktemp("torchrun"), "torchrun", None)
    spec.train.num_gpus = 2
    ranks.launch(spec, **_batch(spec))
    return spec


@pytest.fixture(scope="module")
def flow_on_ray(prefect_harness, ray_address, tmp_path_factory):
    """The whole finetune flow with train.cluster (load and attach deferred, packed_sft on Ray, merge and GGUF here),
    with one of its two workers killed once the first checkpoint is in: as a node that dies."""
    from slimtune.flows.finetune import finetune

    spec = _spec(tmp_path_factory.mktemp("ray-flow"), "on-ray", ray_address)
    killed: list[int] = []
    killer = threading.Thread(target=_kill_a_worker_after_the_first_checkpoint, args=(spec, killed), daemon=True)
    killer.start()
    state = finetune(spec, return_state=True)
    killer.join(timeout=10)
    return spec, state, killed


def _kill_a_worker_after_the_first_checkpoint(spec: PipelineSpec, killed: list[int]) -> None:
    first = spec.run_dir() / "checkpoints" / f"checkpoint-{_SAVE}" / "COMPLETE"
    deadline = time.monotonic() + 400
    while not first.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    victims = _workers()
    if first.is_file() and len(victims) == 2:
        victims[-1].send_signal(signal.SIGKILL)  # no exception, no cleanup: what a dying node does
        killed.append(victims[-1].pid)


def test_a_killed_worker_resumes_and_the_flow_ends_with_the_uninterrupted_adapter(flow_on_ray, uninterrupted, tmp_path):
    from test_ddp import _LOSS_ATOL, _LOSS_ATOL_LATER, _single_process

    spec, state, killed = flow_on_ray
    assert state.is_completed(), state
    assert len(killed) == 1, "the first checkpoint never came, or not with 2 workers"
    summary = state.result()
    assert "2 Ray workers" in summary["load_4bit"]["reason"] and summary["attach_lora"]["handle"] is None
    trained = summary["packed_sft"]
    assert trained["world_size"] == 2 and trained["backend"] == "gloo" and trained["steps"] == _STEPS
    assert [r["rank"] for r in trained["ranks"]] == [0, 1] and all(r["tokens_seen"] > 0 for r in trained["ranks"])
    # Ray restarted the group, which resumed from a checkpoint rather than from the start
    resumed_at = int(Path(trained["resumed_from"]).name.removeprefix("checkpoint-"))
    assert resumed_at in range(_SAVE, _STEPS, _SAVE), trained["resumed_from"]
    assert killed[0] not in [p.pid for p in _workers()]

    # the data order and the optimizer state came back with the checkpoint: the uninterrupted run's adapter
    mine, reference = _adapter(spec.run_dir()), _adapter(uninterrupted.run_dir())
    assert mine.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(mine[key], reference[key], rtol=0, atol=1e-6, msg=key)
    reference_losses = {
        e["step"]: e["loss"] for e in json.loads((uninterrupted.run_dir() / "train_report.json").read_text())["losses"]
    }
    assert [e["step"] for e in trained["losses"]] == list(range(1, _STEPS + 1))
    for entry in trained["losses"]:
        assert entry["loss"] == pytest.approx(reference_losses[entry["step"]], abs=1e-5), entry

    # and as one process with the same effective batch: micro-batch 4 against 2 workers x micro-batch 2
    single_spec = _spec(tmp_path, "single", None)
    single_spec.train.max_steps = 4
    single = _single_process(single_spec, micro_batch_size=4)
    for mine_entry, ref in zip(trained["losses"], single["losses"]):
        atol = _LOSS_ATOL.get(ref["step"], _LOSS_ATOL_LATER)
        assert mine_entry["loss"] == pytest.approx(ref["loss"], abs=atol), (mine_entry, ref)
    assert trained["losses"][-1]["loss"] < trained["losses"][0]["loss"] - 0.3  # it trained

    run_dir = spec.run_dir()
    assert trained["adapter_dir"] == str(run_dir.resolve() / "adapter")
    assert json.loads((run_dir / "train_report.json").read_text())["steps"] == _STEPS
    # the flow merged and exported what the workers trained
    assert (run_dir / "merged" / "config.json").is_file() and list((run_dir / "gguf").glob("*f16*.gguf"))
    # Ray kept the run's last checkpoints (and the result) in its storage, under the run's name
    stored = sorted(int(p.name.split("-")[1]) for p in (run_dir / "ray" / spec.name).glob("checkpoint-*"))
    assert stored[-1] == _STEPS and set(stored) <= set(range(_SAVE, _STEPS + 1, _SAVE)), stored
    assert len(list((run_dir / "ray" / spec.name).glob("result-*"))) == 1
    assert not list(run_dir.glob(".ray-*"))  # the job folder is gone
    assert not _workers()  # the job's workers ended with it


def test_rank_zeros_progress_reaches_the_tasks_artifacts(flow_on_ray):
    """The workers are no Prefect runs: only the task's replay of rank 0's progress lines draws the loss curve."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from slimtune.report.artifacts import run_key
    from slimtune.report.charts import LOSS_CURVE_KIND

    spec, state, _ = flow_on_ray
    with get_client(sync_client=True) as client:
        curve = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[run_key(spec.name, LOSS_CURVE_KIND)]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
            )
        )
    assert len(curve) == 1 and "data:image/png;base64," in curve[0].data, curve


def test_the_relay_publishes_what_the_callback_does_in_the_process(monkeypatch, capsys):
    """Rank 0's `ProgressEvents` lines, fed to `ProgressRelay` (with a launcher's prefix), give the same progress
    updates and loss curve as `stage_progress` run in the training process itself."""
    from transformers import TrainerControl, TrainerState

    import slimtune.train.callbacks as callbacks

    calls: list = []
    monkeypatch.setattr(callbacks, "in_run", lambda: True)
    monkeypatch.setattr(
        callbacks, "publish_progress", lambda key, pct, text, artifact_id=None: calls.append((key, pct, text)) or "id"
    )
    monkeypatch.setattr(callbacks, "publish_image", lambda key, title, png, text: calls.append((key, title)))
    monkeypatch.setattr(callbacks, "loss_curve_png", lambda train, evals: repr((train, evals)).encode())

    def drive(callback) -> None:
        state = TrainerState(global_step=0, max_steps=4, log_history=[{"step": 0, "eval_loss": 3.0}])
        callback.on_train_begin(None, state, TrainerControl())
        for step in range(1, 5):
            state.global_step = step
            callback.on_step_end(None, state, TrainerControl(should_log=True))
            callback.on_log(None, state, TrainerControl(), logs={"loss": 3.0 - step / 4, "tokens_per_s": 900.0})
        callback.on_train_end(None, state, TrainerControl())

    drive(callbacks.stage_progress("run"))
    direct, calls[:] = list(calls), []
    drive(callbacks.ProgressEvents())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and all(line.startswith(callbacks.PROGRESS_EVENT) for line in lines)
    relay = ranks.ProgressRelay("run")
    assert not relay.feed("(RayTrainWorker pid=7) [rank 0] slimtune.train: step 1/4 loss 2.75")  # a log line
    for line in lines:
        assert relay.feed(f"\x1b[36m(RayTrainWorker pid=7)\x1b[0m {line}")
    assert calls == direct and any(title == "Loss curve" for _, title, *_ in direct)


def _no_local_run() -> dict:
    raise AssertionError("a cluster run trains on Ray, never in this process")


def test_stopping_the_driver_stops_the_ray_job(ray_address, tmp_path):
    """What cancelling the task (or Ctrl-C) does: `run_relayed` ends the driver's process group; Ray then ends the
    job's workers, which would otherwise keep the cluster's GPUs."""
    spec = _spec(tmp_path, "stopped", ray_address)
    spec.train.max_steps = 400  # still running when it is stopped
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job = {"spec": spec.model_dump(mode="json"), "backend": "gloo", **_batch(spec)}
    (job_dir / "job.json").write_text(json.dumps(job))
    driver = subprocess.Popen(
        [sys.executable, "-m", "slimtune.flows.ray_train", str(job_dir)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 300
        while len(_workers()) < 2 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_workers()) == 2, "the job's workers never started"
    finally:
        os.killpg(driver.pid, signal.SIGTERM)
        driver.wait(timeout=60)
    deadline = time.monotonic() + 60
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _workers(), "the Ray job outlived its driver"


def test_a_cluster_too_small_for_the_job_is_refused_with_the_numbers(ray_address, tmp_path):
    spec = _spec(tmp_path, "too-many", ray_address, workers=3)
    with pytest.raises(RuntimeError, match=r"num_workers 3 needs 3 CPUs; the Ray cluster at .* has 2; add nodes"):
        ranks.run_stage(spec, "packed_sft", _no_local_run, **_batch(spec))
    assert registry.handles() == []


@pytest.mark.parametrize(
    "change,message",
    [
        ({"train": {"num_gpus": 2}}, "train.num_gpus is 2 with train.cluster"),
        ({"train": {"micro_batch_size": "auto"}}, "micro_batch_size auto with train.cluster"),
        ({"model": {"device": "auto"}}, "gpus_per_worker 0 with model.device auto"),
        ({"model": {"device": "cuda:1"}}, "gpus_per_worker 0 with model.device cuda:1"),
        ({"train": {"cluster": {"address": "head node"}}}, "'head node' is not auto, host:port or ray://host:port"),
        ({"train": {"cluster": {"gpus_per_worker": 2}}}, "gpus_per_worker"),
        ({"train": {"stored_layers": 3}}, "train.stored_layers is 3 with 2 ranks"),
    ],
)
def test_cluster_specs_that_cannot_run_are_refused_before_anything_loads(tmp_path, change, message):
    raw = _spec(tmp_path, "bad", "auto").model_dump(mode="json")
    for section, fields in change.items():
        for key, value in fields.items():
            if isinstance(value, dict):
                raw[section][key].update(value)
            else:
                raw[section][key] = value
    spec_file = tmp_path / "spec.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match=message):
        load_spec(spec_file)


def test_without_the_ray_extra_the_spec_names_the_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'slimtune\[ray\]'"):
        ClusterSpec(num_workers=2)


def test_the_returned_adapter_replaces_an_older_one_and_leaves_the_same_one_alone(tmp_path):
    """On machines that share no run directory the adapter reaches the flow through Ray's storage (`_place_adapter`)."""
    from slimtune.flows.ray_train import _place_adapter

    returned, run_dir = tmp_path / "returned", tmp_path / "run"
    (returned / "adapter").mkdir(parents=True)
    (returned / "adapter" / "adapter_model.safetensors").write_bytes(b"new weights")
    (returned / "train_report.json").write_text('{"steps": 12}')
    (run_dir / "adapter").mkdir(parents=True)
    (run_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"an older run's")
    (run_dir / "adapter" / "stale.txt").write_text("gone after")
    _place_adapter(returned, run_dir)
    assert sorted(p.name for p in (run_dir / "adapter").iterdir()) == ["adapter_model.safetensors"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").read_bytes() == b"new weights"
    assert (run_dir / "train_report.json").read_text() == '{"steps": 12}'
    before = (run_dir / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns
    _place_adapter(returned, run_dir)  # rank 0 wrote these very files (a shared run directory): untouched
    assert (run_dir / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns == before
    assert not list(run_dir.glob(".*ray-staging"))


def test_rays_latest_checkpoint_is_copied_only_where_the_run_directory_lacks_it(tmp_path):
    from types import SimpleNamespace

    from slimtune.flows.ray_train import restore_checkpoint
    from slimtune.train import checkpoints

    stored = tmp_path / "ray" / "run" / "checkpoint-8"
    stored.mkdir(parents=True)
    (stored / checkpoints.COMPLETE).write_text("{}")
    (stored / "optimizer.pt").write_bytes(b"state")

    def checkpoint(path):
        return SimpleNamespace(path=str(path), to_directory=lambda d: shutil.copytree(path, d, dirs_exist_ok=True))

    root = tmp_path / "run" / "checkpoints"
    copied = restore_checkpoint(root, checkpoint(stored))  # a node that did not write it
    assert copied == root / "checkpoint-8" and (copied / "optimizer.pt").read_bytes() == b"state"
    assert (copied / checkpoints.COMPLETE).is_file() and [p.name for p in root.iterdir()] == ["checkpoint-8"]
    assert restore_checkpoint(root, checkpoint(stored)) is None  # the run directory has it
    result = tmp_path / "ray" / "run" / "result-1"
    result.mkdir()
    assert restore_checkpoint(tmp_path / "other", checkpoint(result)) is None  # a finished run's result
    assert restore_checkpoint(root, None) is None and not (tmp_path / "other").exists()
