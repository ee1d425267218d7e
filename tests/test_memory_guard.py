"""The memory guard: classification, preflight, sampling, cleaning, ladders, and Prefect retries."""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
import time
import weakref
from pathlib import Path

import psutil
import pytest
import torch
from prefect import flow, task

from slimtune.flows.gpu_slots import gpu_concurrency
from slimtune.memory.clean import clean_memory
from slimtune.memory.device_usage import outside_allocator_bytes
from slimtune.memory.downshift import (
    DownshiftExhausted,
    current_attempt,
    downshift_merge,
    downshift_train,
    retry_on_memory_pressure,
)
from slimtune.memory.errors import MemoryPressure, PreflightError, classify, memory_state
from slimtune.memory.guard import GuardRecord, guarded, max_memory_with_headroom, preflight
from slimtune.memory.sampler import PeakSampler
from slimtune.memory.stage_estimate import Estimate
from slimtune.report.memory_report import artifact_key, publish_memory_report, publish_task_report
from slimtune.report.run_report import render_memory_markdown

_GIB = 1024**3
_MIB = 1024**2


# --- classify -------------------------------------------------------------------------------------


def _raise_from(outer: Exception, inner: Exception) -> Exception:
    outer.__cause__ = inner  # what `raise outer from inner` sets
    return outer


def test_classify_memory_failures():
    real_cpu_oom = None
    try:
        # 10 TB: the CPU allocator refuses at once (no pages are touched), a real allocation failure.
        torch.empty(10**13, dtype=torch.uint8)
    except RuntimeError as e:
        real_cpu_oom = e
    assert real_cpu_oom is not None and classify(real_cpu_oom)
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert classify(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert classify(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"))
    assert classify(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert classify(MemoryError())
    assert classify(subprocess.CalledProcessError(-9, ["llama-quantize"]))
    assert classify(subprocess.CalledProcessError(137, ["sh", "-c", "quantize"]))
    err = ChildProcessError("child died")
    err.returncode = -9
    assert classify(err)
    assert classify(_raise_from(RuntimeError("loading shard 3 failed"), torch.OutOfMemoryError("oom")))


def test_classify_leaves_other_errors_alone():
    assert not classify(ValueError("micro_batch_size must be positive"))
    assert not classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not classify(subprocess.CalledProcessError(1, ["llama-quantize"]))
    assert not classify(KeyError("model.layers.0"))
    # bitsandbytes' paged-allocation failure is recognised by where it was raised, not by text alone.
    assert not classify(ValueError("NULL pointer access"))


def test_memory_pressure_pickles_with_its_state():
    err = MemoryPressure("packed_sft", memory_state("cpu"), "OutOfMemoryError: CUDA out of memory")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, MemoryPressure)
    assert back.stage == "packed_sft" and back.state == err.state and str(back) == str(err)
    assert "host available" in str(back)


# --- guarded ---------------------------------------------------------------------------------------


def test_guarded_turns_oom_into_memory_pressure_and_keeps_the_record():
    seen: list[GuardRecord] = []
    original = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    with (
        pytest.raises(MemoryPressure) as info,
        guarded("packed_sft", estimate=None, device="cpu", attempt=2, downshifts=["a"], on_exit=seen.append),
    ):
        raise original
    assert info.value.__cause__ is original
    assert info.value.stage == "packed_sft" and "Tried to allocate 8.00 GiB" in str(info.value)
    assert info.value.record is seen[0]
    record = seen[0]
    assert record.outcome == "out of memory" and record.attempts == 2 and record.downshifts == ["a"]
    assert record.peak_host_rss > 0 and record.seconds > 0


def test_guarded_passes_other_errors_through_unchanged():
    seen: list[GuardRecord] = []
    with (
        pytest.raises(ValueError, match="bad shape") as info,
        guarded("packed_sft", estimate=None, device="cpu", on_exit=seen.append),
    ):
        raise ValueError("bad shape")
    assert not isinstance(info.value, MemoryPressure)
    assert seen[0].outcome == "failed: ValueError"


def test_guarded_frees_the_failed_attempts_tensors():
    """Frames of an OOM traceback hold the body's tensors; the guard clears them before a retry."""
    refs = []

    def step():
        activations = torch.ones(1024, 1024)
        refs.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(MemoryPressure) as info, guarded("packed_sft", estimate=None, device="cpu"):
        step()
    gc.collect()
    assert info.value.__cause__ is not None  # the error is still alive, its frames' locals are not
    assert refs[0]() is None


def test_guarded_samples_peak_host_rss():
    before = psutil.Process().memory_info().rss
    with guarded("load_4bit", estimate=None, device="cpu", sample_interval_s=0.01) as record:
        block = torch.ones(64 * _MIB)  # 256 MiB of touched float32 pages
    # Still alive when the guard took its closing sample: the record holds it however busy the machine was
    # (the background thread's own sampling is tested on PeakSampler directly).
    del block
    assert record.outcome == "completed"
    assert record.peak_host_rss >= before + 200 * _MIB
    assert record.peak_gpu_allocated is None  # CPU device: no GPU numbers are invented


def test_sampler_waits_at_least_200x_its_last_sample_cost():
    """The spacing rule that bounds the sampler's share of wall time, checked without timing anything."""

    class _Stop:
        def __init__(self) -> None:
            self.waits: list[float] = []

        def wait(self, timeout: float) -> bool:  # the sampler thread's sleep; stop after four
            self.waits.append(timeout)
            return len(self.waits) > 4

    sampler = PeakSampler("cpu", interval_s=0.05)
    costs = iter([0.0001, 0.002, 0.0005, 0.004])

    def costly_sample() -> None:
        sampler.samples += 1
        sampler.sample_seconds += next(costs)

    sampler.sample = costly_sample  # this instance only: a sample whose cost is known
    sampler._stop = _Stop()
    sampler._run()
    # The first wait is the interval; each later one is max(interval, 200 x the previous sample's cost).
    assert sampler._stop.waits == pytest.approx([0.05, 0.05, 0.4, 0.1, 0.8])
    assert sampler.samples == 4


def test_sampler_records_host_rss_and_counts_its_samples():
    with PeakSampler("cpu", interval_s=0.01) as running:
        block = bytearray(64 * _MIB)
        deadline = time.monotonic() + 60
        while running.samples < 3 and time.monotonic() < deadline:  # the thread samples while we wait
            time.sleep(0.01)
        del block
    assert running.samples >= 3
    assert running.peak_host_rss >= 64 * _MIB
    assert 0.0 <= running.overhead < 1.0


# --- preflight --------------------------------------------------------------------------------------


def test_preflight_host_shortfall_fails_before_allocating():
    available = psutil.virtual_memory().available
    est = Estimate(
        gpu_bytes=0,
        host_bytes=available + 50 * _GIB,
        disk_bytes=0,
        breakdown={"host: offloaded layer inputs (pinned)": available + 50 * _GIB},
        fields={"host": "lora.gradient_checkpointing"},
    )
    allocations = []
    with pytest.raises(PreflightError) as info, guarded("packed_sft", estimate=est, device="cpu"):
        allocations.append(torch.ones(1))
    assert allocations == []
    msg = str(info.value)
    assert "packed_sft" in msg and "host memory" in msg
    assert f"{est.host_bytes / _GIB:.2f} GiB" in msg
    free_shown = float(msg.split("only ")[1].split(" GiB")[0])  # what is free, in GiB, read as the guard did
    assert abs(free_shown - available / _GIB) < 1.0  # other processes move it between the two reads
    assert "offloaded layer inputs" in msg and "lora.gradient_checkpointing" in msg


def test_preflight_counts_gpu_terms_as_host_on_cpu_and_checks_disk(tmp_path):
    available = psutil.virtual_memory().available
    est = Estimate(
        gpu_bytes=available,
        host_bytes=available // 2,
        disk_bytes=10**18,
        breakdown={"gpu: nf4 linears": available, "disk: merged model": 10**18},
        fields={"gpu": "train.micro_batch_size", "host": "host memory", "disk": "output_dir"},
    )
    with pytest.raises(PreflightError) as info:
        preflight(est, device="cpu", disk_path=tmp_path / "not" / "yet", stage="dequant_merge")
    msg = str(info.value)
    assert "host memory" in msg and "train.micro_batch_size" in msg
    assert "disk space" in msg and "output_dir" in msg and str(tmp_path) in msg
    # A small estimate passes.
    preflight(Estimate(0, 1, 1), device="cpu", disk_path=tmp_path)


def test_a_gpu_estimate_over_the_budget_by_no_more_than_its_fragmentation_allowance_runs_with_a_warning(
    monkeypatch, caplog
):
    """8B at 1 x 2048 with the lm_head on the GPU: 6.78 GiB estimated, 0.56 GiB of it the allowance for allocator
    fragmentation. A card that holds its tensors but not the allowance runs with a warning naming both; a card that
    does not hold its tensors is refused. The device is stood in for: `_gpu_checks` reads a GPU's free memory."""
    from model_configs import LLAMA_8B

    from slimtune.memory import guard as guard_module
    from slimtune.memory.estimate import estimate_train

    est = estimate_train(
        LLAMA_8B, micro_batch=1, seq_len=2048, lora_r=16, target_modules="all-linear", checkpointing="unsloth"
    )
    allowance = est.breakdown["gpu: allocator fragmentation"]
    assert est.allowance() == allowance > 0.5 * _GIB
    card: list[int] = []
    where = "in the budget on cuda:0 (device-wide: context included)"
    monkeypatch.setattr(guard_module, "_gpu_checks", lambda est, dev, budget: [(est.gpu_bytes, card[0], where)])

    card.append(est.gpu_bytes - allowance // 2)
    with caplog.at_level("WARNING", logger="slimtune.memory.guard"):
        preflight(est, device="cuda", disk_path=None, stage="packed_sft")
    assert "packed_sft: a tight fit" in caplog.text and f"{allowance / _GIB:.2f} GiB of the estimate" in caplog.text
    card[0] = est.gpu_bytes - allowance - _MIB
    with pytest.raises(PreflightError, match="packed_sft: not enough GPU memory"):
        preflight(est, device="cuda", disk_path=None, stage="packed_sft")


def test_max_memory_with_headroom_keeps_ten_percent():
    limits = max_memory_with_headroom("cpu")
    available = psutil.virtual_memory().available
    assert set(limits) == {"cpu"}
    assert 0.85 * available <= limits["cpu"] <= 0.90 * available * 1.02


# --- clean ------------------------------------------------------------------------------------------


class _Node:
    def __init__(self) -> None:
        self.partner: _Node | None = None
        self.payload = torch.ones(256, 256)


def test_clean_memory_frees_reference_cycles():
    a, b = _Node(), _Node()
    a.partner, b.partner = b, a  # a cycle: reference counting alone never frees it
    ref = weakref.ref(a.payload)
    gc.disable()
    try:
        del a, b
        assert ref() is not None
        clean_memory()
        assert ref() is None
    finally:
        gc.enable()


class _Releaser:
    """Garbage in a cycle whose finalizer drops the last outside reference to another cycle (a hook's handle)."""

    held: list[_Node] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _Releaser.held.clear()


def test_clean_memory_frees_a_cycle_that_only_a_finalizer_lets_go():
    """The first pass runs the finalizer; only a second pass can free what it let go: the passes end at one that
    finds nothing, not after the first."""
    gc.disable()
    try:
        a, b = _Node(), _Node()
        a.partner, b.partner = b, a
        ref = weakref.ref(a.payload)
        _Releaser.held.append(a)
        _Releaser()
        del a, b
        clean_memory()
        assert ref() is None
    finally:
        _Releaser.held.clear()
        gc.enable()


def test_cleanup_drops_the_nf4_dequantization_scratch():
    """Module state, not model state: it outlived the model and kept cleanup 32 MiB off baseline (1B on an H100).
    The cleanup task names it to clean_memory; the guard's own cleaning between stages leaves it alone."""
    import bitsandbytes.functional as bnbf

    from slimtune.kernels import nf4, scratch
    from slimtune.tasks.cleanup import MemorySnapshot, cleanup

    packed, state = bnbf.quantize_4bit(torch.randn(64, 128), blocksize=64, compress_statistics=True, quant_type="nf4")
    nf4.dequantize_nf4_scratch(packed, state)
    assert scratch.BUFFERS
    clean_memory()
    assert scratch.BUFFERS  # memory/ does not reach into the kernels
    cleanup(MemorySnapshot.take().to_dict())
    assert not scratch.BUFFERS


def test_cleanup_names_what_still_holds_a_released_model(monkeypatch):
    """A model registered, released by cleanup, but still referenced from a module global through a callback
    (as a Trainer's callbacks reference it): cleanup reports the chain; without the holder, no survivor."""
    import types

    from slimtune.core import registry
    from slimtune.tasks.cleanup import MemorySnapshot, cleanup

    holder = types.ModuleType("leaky_globals")
    monkeypatch.setitem(sys.modules, "leaky_globals", holder)

    class Callback:
        def __init__(self, model):
            self.model = model

    registry.put("model", torch.nn.Linear(4, 4))
    holder.CALLBACKS = [Callback(registry.get(registry.handles()[-1]))]
    kept = cleanup(MemorySnapshot.take().to_dict())
    (handle,) = kept.survivors
    assert handle.startswith("model-")
    chains = kept.survivors[handle]
    assert any(c.startswith("globals of leaky_globals -> builtins.list -> ") and "Callback" in c for c in chains)
    registry.put("model", torch.nn.Linear(4, 4))
    assert cleanup(MemorySnapshot.take().to_dict()).survivors == {}


def test_live_tensors_sums_reachable_storages_and_names_the_holder_of_the_largest(monkeypatch):
    """What cleanup reports when GPU memory stays off baseline, checked on the CPU: a view shares its base's
    storage (counted once), and the largest tensor's chain ends at the module global that keeps it."""
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from slimtune.memory.holders import live_tensors

    with FunctionalTensorMode():  # a traced tensor left alive (seen in the full suite): its storage has no address
        traced = torch.ones(3) + 1
    with FakeTensorMode():  # torch.compile's pattern matcher keeps fake tensors (CI): they own no memory
        fake = torch.empty(1024, 128, 128)  # "64 MiB" on a meta storage
    before, _ = live_tensors("cpu", limit=0)
    holder = types.ModuleType("leaky_tensors")
    monkeypatch.setitem(sys.modules, "leaky_tensors", holder)
    weight = torch.zeros(2048, 1024)  # 8 MiB
    holder.STATE = {"weight": weight, "view": weight[:10]}
    del weight
    total, largest = live_tensors("cpu", limit=1)
    assert total - before == 8 * 2**20
    assert largest[0].startswith("(2048, 1024) torch.float32 8.0 MiB, held by: globals of leaky_tensors -> dict")
    del traced, fake


# --- ladders ----------------------------------------------------------------------------------------


def test_train_ladder_halves_micro_batch_then_offloads_then_gives_advice():
    shifts = [downshift_train(8, 2, True, attempt) for attempt in range(1, 6)]
    assert [(s.micro_batch, s.grad_accum) for s in shifts] == [(8, 2), (4, 4), (2, 8), (1, 16), (1, 16)]
    assert all(s.micro_batch * s.grad_accum == 16 for s in shifts)
    assert [s.checkpointing for s in shifts] == [True, True, True, True, "unsloth"]
    assert shifts[0].notes == () and len(shifts[4].notes) == 4
    assert "8 -> 4" in shifts[1].notes[0] and "'unsloth'" in shifts[4].notes[-1]
    with pytest.raises(DownshiftExhausted, match="data.max_seq_length"):
        downshift_train(8, 2, True, 6)
    # Odd micro-batches keep the effective batch exact: 6 -> 3 -> 1.
    assert [(s.micro_batch, s.grad_accum) for s in (downshift_train(6, 1, "unsloth", a) for a in (2, 3))] == [
        (3, 2),
        (1, 6),
    ]


def test_merge_ladder_lowers_maximum_memory_usage_to_a_floor():
    values = [downshift_merge(0.35, a).maximum_memory_usage for a in (1, 2, 3, 4)]
    assert values == [0.35, 0.25, 0.15, 0.1]
    assert "0.25 -> 0.15" in downshift_merge(0.35, 3).notes[-1]
    with pytest.raises(DownshiftExhausted, match="merge.max_shard_size"):
        downshift_merge(0.35, 5)


def test_current_attempt_outside_prefect_is_one():
    assert current_attempt() == 1


def test_reports_outside_a_run_are_no_ops():
    record = GuardRecord(stage="packed_sft", estimate=None, budget=None)
    assert publish_task_report(record) is None
    assert publish_memory_report([record]) is None
    assert artifact_key("Packed_SFT step") == "memory-packed-sft-step"
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # No run and no API (another test's Prefect server may have set one): nothing to wait for.
    with temporary_settings(restore_defaults={PREFECT_API_URL}), gpu_concurrency():
        pass


# --- Prefect: retry on memory pressure, not on other errors, artifacts on the flow run ---------------

_SEQ_LEN = 512
# The fake GPU fits 4 x 512 tokens: micro-batch 8 "runs out of memory" as a real step would.
_TOKEN_BUDGET = 4 * _SEQ_LEN


def _train_step(micro_batch: int, calls: list[tuple[int, int]], grad_accum: int) -> None:
    calls.append((micro_batch, grad_accum))
    if micro_batch * _SEQ_LEN > _TOKEN_BUDGET:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {micro_batch * 64} MiB")


_calls: list[tuple[int, int]] = []
_batches: list[weakref.ref] = []


@task(retries=4, retry_delay_seconds=0, retry_condition_fn=retry_on_memory_pressure)
def _packed_sft(micro_batch: int, grad_accum: int) -> dict:
    shift = downshift_train(micro_batch, grad_accum, True, current_attempt())
    # Whether the previous attempt's batch, a local of this very frame, was freed before this attempt.
    previous_freed = all(ref() is None for ref in _batches)
    with guarded(
        "packed_sft", estimate=None, device="cpu", downshifts=list(shift.notes), on_exit=publish_task_report
    ) as record:
        batch = torch.ones(shift.micro_batch, _SEQ_LEN)
        _batches.append(weakref.ref(batch))
        _train_step(shift.micro_batch, _calls, shift.grad_accum)
    return {
        "micro_batch": shift.micro_batch,
        "grad_accum": shift.grad_accum,
        "record": record,
        "previous_freed": previous_freed,
    }


@task(retries=3, retry_delay_seconds=0, retry_condition_fn=retry_on_memory_pressure)
def _broken(micro_batch: int) -> None:
    _calls.append((micro_batch, current_attempt()))
    with guarded("packed_sft", estimate=None, device="cpu"):
        raise ValueError("train.micro_batch_size must divide the dataset; got 7")


@task(retries=3, retry_delay_seconds=0, retry_condition_fn=retry_on_memory_pressure)
def _too_big() -> None:
    est = Estimate(0, psutil.virtual_memory().available * 4, 0, {}, {"host": "train.micro_batch_size"})
    with guarded("packed_sft", estimate=est, device="cpu"):
        _calls.append((-1, current_attempt()))


@flow
def _finetune_like(micro_batch: int, grad_accum: int) -> dict:
    with gpu_concurrency():
        out = _packed_sft(micro_batch, grad_accum)
    publish_memory_report([out["record"]])
    return {k: v for k, v in out.items() if k != "record"} | {"downshifts": out["record"].downshifts}


def test_oom_on_first_attempt_retries_with_half_the_micro_batch(prefect_harness):
    _calls.clear()
    _batches.clear()
    state = _finetune_like(8, 2, return_state=True)
    out = state.result()
    assert _calls == [(8, 2), (4, 4)]
    assert out["micro_batch"] == 4 and out["grad_accum"] == 4
    assert out["micro_batch"] * out["grad_accum"] == 8 * 2  # same effective batch
    assert len(out["downshifts"]) == 1 and "8 -> 4" in out["downshifts"][0]
    assert out["previous_freed"]  # the failed attempt's tensors did not survive into the retry

    # The memory artifacts are attached to this flow run.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    by_key: dict[str, list] = {}
    for artifact in artifacts:
        by_key.setdefault(artifact.key, []).append(artifact)
    assert set(by_key) == {"memory-packed-sft", "memory-report"}
    assert len(by_key["memory-packed-sft"]) == 2  # one table per attempt
    # Table artifacts come back as a JSON string of the rows.
    outcomes = sorted(json.loads(a.data)[0]["outcome"] for a in by_key["memory-packed-sft"])
    assert outcomes == ["completed", "out of memory"]
    assert "8 -> 4" in by_key["memory-report"][0].data


def test_value_error_is_not_retried(prefect_harness):
    _calls.clear()

    @flow
    def run() -> None:
        _broken(7)

    state = run(return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="must divide the dataset"):
        state.result()
    assert _calls == [(7, 1)]


def test_preflight_shortfall_is_not_retried_and_allocates_nothing(prefect_harness):
    _calls.clear()

    @flow
    def run() -> None:
        _too_big()

    state = run(return_state=True)
    with pytest.raises(PreflightError, match="train.micro_batch_size"):
        state.result()
    assert _calls == []


def test_gpu_concurrency_holds_a_slot_of_the_gpu_limit(prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="gpu-test", limit=1))

    @flow
    def run() -> int:
        with gpu_concurrency("gpu-test"), get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name("gpu-test").active_slots

    assert run() == 1
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("gpu-test").active_slots == 0


def test_gpu_concurrency_creates_a_missing_limit_with_one_slot(prefect_harness, caplog):
    """No "Concurrency limits ['gpu'] do not exist" warning: the limit is created, then held."""
    from prefect.client.orchestration import get_client

    @flow
    def run() -> int:
        with gpu_concurrency("gpu-missing"), get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name("gpu-missing").active_slots

    assert run() == 1
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("gpu-missing")
    assert (limit.limit, limit.active_slots) == (1, 0)
    assert "do not exist" not in caplog.text
    assert run() == 1  # the second run finds it and keeps it


def test_a_multi_gpu_run_holds_one_slot_per_gpu(prefect_harness):
    """The limit counts GPUs: a 2-GPU run holds 2 of its slots, so a 1-GPU run fits beside it only in a third."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="gpu-three", limit=3))

    def active() -> int:
        with get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name("gpu-three").active_slots

    @flow
    def run() -> list[int]:
        with gpu_concurrency("gpu-three", gpus=2):
            held = [active()]
            with gpu_concurrency("gpu-three", gpus=1):
                held.append(active())
            return [*held, active()]

    assert run() == [2, 3, 2]
    assert active() == 0


def test_a_missing_limit_is_made_for_the_gpus_and_a_small_one_names_the_fix(prefect_harness):
    from prefect.client.orchestration import get_client

    @flow
    def run(slot: str, gpus: int) -> int:
        with gpu_concurrency(slot, gpus=gpus), get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name(slot).active_slots

    assert run("gpu-made-for-two", 2) == 2  # created with max(1, gpus, visible GPUs) slots: 2 on this CPU host
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("gpu-made-for-two").limit == 2
    run("gpu-one", 1)
    with pytest.raises(ValueError, match=r"limit 'gpu-one' has 1 slot.*prefect gcl update gpu-one --limit 2"):
        run("gpu-one", 2)


def test_report_markdown_lists_downshifts():
    records = [
        GuardRecord(
            stage="packed_sft",
            estimate=Estimate(3 * _GIB, _GIB, 0),
            budget=None,
            attempts=2,
            downshifts=["attempt 2: micro-batch 8 -> 4"],
            outcome="completed",
            peak_host_rss=_GIB,
        ),
        GuardRecord(stage="dequant_merge", estimate=None, budget=None, outcome="completed"),
    ]
    md = render_memory_markdown(records)
    assert "| packed_sft | completed | 2 | 3.00 |" in md
    assert "- packed_sft: attempt 2: micro-batch 8 -> 4" in md
    assert "dequant_merge" in md


# --- GPU: a real out-of-memory under a budget, recovered at a smaller micro-batch ---------------------

_ACT_BYTES_PER_SAMPLE = 512 * _MIB


@task(retries=4, retry_delay_seconds=0, retry_condition_fn=retry_on_memory_pressure)
def _gpu_step(micro_batch: int, grad_accum: int, budget_fraction: float) -> dict:
    shift = downshift_train(micro_batch, grad_accum, True, current_attempt())
    with guarded(
        "packed_sft",
        estimate=None,
        device="cuda",
        budget_fraction=budget_fraction,
        downshifts=list(shift.notes),
        on_exit=publish_task_report,
    ) as record:
        weights = torch.randn(4096, 4096, device="cuda", requires_grad=True)  # 64 MiB
        # Activations grow with the micro-batch: 512 MiB per sample across four saved tensors.
        x = torch.randn(shift.micro_batch, _ACT_BYTES_PER_SAMPLE // 4 // 4 // 4096, 4096, device="cuda")
        h = x
        for _ in range(3):
            h = torch.tanh(h @ weights)
        h.sum().backward()
        torch.cuda.synchronize()
        del weights, x, h
    return {
        "micro_batch": shift.micro_batch,
        "grad_accum": shift.grad_accum,
        "peak": record.peak_gpu_allocated,
        "overhead": record.sampler_overhead,
        "device_used": record.peak_device_used,
        "notes": record.downshifts,
    }


@pytest.mark.gpu
def test_gpu_budget_oom_recovers_at_smaller_micro_batch(prefect_harness):
    torch.cuda.init()
    clean_memory()
    baseline = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    # Micro-batch m saves 4 x 128 MiB per sample plus a 128 MiB transient and ~the same again in
    # gradients during backward (~0.8 GiB/sample): 4.5 GiB fits m = 4 (~3.2 GiB), not m = 8 (~6.5 GiB).
    # The budget is device-wide: what CUDA holds outside the allocator comes on top.
    outside = outside_allocator_bytes(torch.device("cuda", 0))
    fraction = (baseline + 4.5 * _GIB + outside) / total

    @flow
    def run() -> dict:
        return _gpu_step(8, 1, fraction)

    out = run()
    after = clean_memory()
    result = {"baseline": baseline, "after": after, "fraction": fraction, **out}
    print("gpu guard:", json.dumps(result))
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "memory_guard_gpu.json").write_text(json.dumps(result, indent=1))
    assert out["micro_batch"] == 4 and out["grad_accum"] == 2
    assert out["peak"] <= fraction * total - outside
    if out["device_used"]:  # this process on the card (or the whole card where NVML cannot tell it apart)
        assert out["device_used"] <= fraction * total + 64 * _MIB, (out["device_used"], fraction * total)
    assert abs(after - baseline) <= 64 * _MIB
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0  # the budget was restored


def test_this_process_on_the_card_is_found_by_pid_or_as_the_one_process_in_a_container():
    """NVML's process ids are the host's inside a container: this process is then the one process listed, when it
    holds a context on the card (else the calibrated context stands in: `outside_allocator_bytes`)."""
    from types import SimpleNamespace

    from slimtune.memory.device_usage import held_by_this_process

    def proc(pid: int, used: int | None) -> SimpleNamespace:
        return SimpleNamespace(pid=pid, usedGpuMemory=used)

    assert held_by_this_process([proc(7, 100), proc(8, 200)], 8, holds_context=True) == 200
    assert held_by_this_process([proc(99999, 300)], 8, holds_context=True) == 300  # a container's one process
    assert held_by_this_process([proc(99999, 300)], 8, holds_context=False) is None  # someone else's
    assert held_by_this_process([proc(1, 300), proc(2, 5)], 8, holds_context=True) is None  # which one is unknown
    assert held_by_this_process([], 8, holds_context=True) is None
