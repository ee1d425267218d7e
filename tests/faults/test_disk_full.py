"""Disk full while writing a checkpoint, the merged shards and the GGUF: a clear error, no partial artifact.

The run directory sits on a small tmpfs mounted by the test; right before the write starts, a ballast
file fills it (another job filling the disk after the preflight passed), so the write itself meets a real
ENOSPC half-way through a file.
"""

from __future__ import annotations

import re

import pytest
from faultlib import fill, leftovers, spec_dict

import slimtune.merge.run as merge_run
import slimtune.tasks.gguf_convert_and_push as gguf_task_mod
from slimtune.core import registry
from slimtune.flows.stages import dequant_merge_task, packed_sft_task
from slimtune.plan.run_plan import resolve_plan
from slimtune.spec.schema import parse_spec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.gguf_convert_and_push import gguf_convert_and_push
from slimtune.tasks.load_4bit import load_4bit
from slimtune.tasks.packed_sft import prepare_data
from slimtune.train.trainer import _SlimTrainer

_MIB = 1024**2
_SPACE = re.compile(r"\d+(\.\d+)?\s*(GiB|MiB|GB|MB|bytes)")  # "the space needed", in some unit


def _clear(message: str, path) -> bool:
    return str(path) in message and bool(_SPACE.search(message))


@pytest.mark.fault(
    "Disk full",
    stage="packed_sft (checkpoint)",
    expect="error naming the checkpoint path and the space needed; no checkpoint published",
)
def test_disk_full_during_checkpoint(small_disk, observe):
    disk = small_disk(64 * _MIB)
    spec = parse_spec(spec_dict(disk, train={"max_steps": 2, "save_steps": 2}))
    plan = resolve_plan(spec)
    examples = prepare_data(spec, plan.model_dir)
    lora = attach_lora(spec, load_4bit(spec, plan).handle)
    real = _SlimTrainer._save_checkpoint

    def save_on_full_disk(self, model, trial):
        fill(disk, 600 * 1024)  # a checkpoint of this adapter is ~1.6 MiB: it runs out half-way
        return real(self, model, trial)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_SlimTrainer, "_save_checkpoint", save_on_full_disk)
        with pytest.raises(Exception) as err:
            packed_sft_task.fn(spec, plan, lora.handle, lora.checkpointing_handle, examples)
    registry.release_all()
    message = f"{type(err.value).__name__}: {err.value}"
    observe(message.replace(str(disk), "…")[:160])
    ckpts = spec.run_dir() / "checkpoints"
    assert not list(ckpts.glob("checkpoint-*")), "a checkpoint was published on a full disk"
    assert _clear(message, spec.run_dir()), message


@pytest.mark.fault(
    "Disk full",
    stage="dequant_merge",
    expect="DiskSpaceError naming the path and the GiB needed; no merged/ and no temporary folder",
)
def test_disk_full_during_merge(small_disk, reference_run, observe):
    disk = small_disk(96 * _MIB)  # the merge's preflight wants ~75 MiB (output + spill bound + slack)
    spec = parse_spec(spec_dict(disk))
    real = merge_run.merge_shards

    def merge_on_full_disk(*args, **kwargs):
        fill(disk, 4 * _MIB)  # the merged shard is ~11 MiB
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merge_run, "merge_shards", merge_on_full_disk)
        with pytest.raises(Exception) as err:
            dequant_merge_task.fn(spec, resolve_plan(spec), str(reference_run["run_dir"] / "adapter"))
    message = str(err.value)
    observe(f"{type(err.value).__name__}: {message.replace(str(disk), '…')[:160]}")
    assert type(err.value).__name__ == "DiskSpaceError" and _clear(message, disk), message
    assert not (spec.run_dir() / "merged").exists()
    assert [p for p in leftovers(spec.run_dir()) if p.startswith(".merged")] == []


@pytest.mark.fault(
    "Disk full",
    stage="dequant_merge (preflight)",
    expect="DiskSpaceError before any byte is written, naming the path and the space needed",
)
def test_disk_too_small_for_merge(small_disk, reference_run, observe):
    disk = small_disk(4 * _MIB)
    spec = parse_spec(spec_dict(disk))
    with pytest.raises(Exception) as err:
        dequant_merge_task.fn(spec, resolve_plan(spec), str(reference_run["run_dir"] / "adapter"))
    message = str(err.value)
    observe(f"{type(err.value).__name__}: {message.replace(str(disk), '…')[:160]}")
    assert _clear(message, disk), message
    assert not (spec.run_dir() / "merged").exists()
    assert not spec.run_dir().exists() or [p for p in leftovers(spec.run_dir()) if p.startswith(".merged")] == []


@pytest.mark.fault(
    "Disk full",
    stage="gguf_convert_and_push",
    expect="error naming the GGUF path and the space needed; no partial .gguf",
)
def test_disk_full_during_gguf(small_disk, reference_run, observe):
    disk = small_disk(16 * _MIB)
    spec = parse_spec(spec_dict(disk))
    run = reference_run["run_dir"]
    real = gguf_task_mod.convert_hf_to_gguf

    def convert_on_full_disk(*args, **kwargs):
        fill(disk, 2 * _MIB)  # the f16 GGUF is ~5.4 MiB
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_task_mod, "convert_hf_to_gguf", convert_on_full_disk)
        with pytest.raises(Exception) as err:
            gguf_convert_and_push(spec, run / "merged", run / "adapter", {"spec": {}, "train": {}})
    message = f"{type(err.value).__name__}: {err.value}"
    observe(message.replace(str(disk), "…")[:160])
    gguf_dir = spec.run_dir() / "gguf"
    assert not list(gguf_dir.glob("*.gguf")) and [p for p in leftovers(spec.run_dir()) if "gguf" in p] == []
    assert _clear(message, gguf_dir), message
