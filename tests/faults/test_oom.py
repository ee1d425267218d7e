"""Out of memory inside each of the six tasks, on its first attempt: retried with its downshift, same outputs.

One faulted flow run covers five stages at once (each OOMs once, at a realistic point inside the stage);
each stage's memory record (run_dir/memory/<stage>.json) attributes its retry. Training is faulted in a run
of its own: its downshift (half the micro-batch, twice the accumulation) changes the floating-point
summation order, so its adapter can only match the clean run within a tolerance, and it would otherwise
blur the byte-for-byte checks of the other stages.
"""

from __future__ import annotations

import json

import pytest
from faultlib import (
    TRAIN_RTOL,
    WIRING_ONLY,
    Once,
    adapter_diff,
    oom,
    run_finetune,
    sha256,
    spec_dict,
    stub_model_stages,
)

import slimtune.export.gguf_write as gguf_write
import slimtune.merge.stream as merge_stream
import slimtune.tasks.attach_lora as attach_lora_mod
import slimtune.tasks.cleanup as cleanup_mod
import slimtune.tasks.load_4bit as load_4bit_mod
from slimtune.memory import MemoryPressure
from slimtune.train.trainer import _SlimTrainer


def _raise_on(counter: Once, where: str, real):
    def wrapper(*args, **kwargs):
        if counter():
            raise oom(where)
        return real(*args, **kwargs)

    return wrapper


@pytest.fixture(scope="module")
def five_stage_oom(tmp_path_factory, reference_run):
    """One run in which load_4bit, attach_lora, dequant_merge and gguf_convert_and_push each OOM once."""
    out = tmp_path_factory.mktemp("oom5")
    counters = {
        "load_4bit": Once(1),
        "attach_lora": Once(1),
        "dequant_merge": Once(5),
        "gguf_convert_and_push": Once(10),
    }
    with pytest.MonkeyPatch.context() as mp:
        # while from_pretrained computes where the weights go, i.e. before the allocation that fails
        mp.setattr(
            load_4bit_mod,
            "max_memory_with_headroom",
            _raise_on(counters["load_4bit"], "load_4bit", load_4bit_mod.max_memory_with_headroom),
        )
        # after peft has injected LoRA into the base model in place, when checkpointing allocates its buffers
        mp.setattr(
            attach_lora_mod,
            "enable_checkpointing",
            _raise_on(counters["attach_lora"], "attach_lora", attach_lora_mod.enable_checkpointing),
        )
        # at the 5th tensor: the temporary output folder exists and holds finished tensors
        mp.setattr(
            merge_stream.TensorMerger,
            "merged_raw",
            _raise_on(counters["dequant_merge"], "dequant_merge", merge_stream.TensorMerger.merged_raw),
        )
        # at the 10th tensor: the temporary GGUF file is half written
        mp.setattr(gguf_write, "_encode", _raise_on(counters["gguf_convert_and_push"], "gguf", gguf_write._encode))
        summary = run_finetune(spec_dict(out))
    return {"run_dir": out / "faults", "summary": summary, "counters": counters}


@pytest.fixture(scope="module")
def train_oom(tmp_path_factory, reference_run):
    """A run whose training OOMs once in its second optimizer step: one step taken, no checkpoint yet."""
    out = tmp_path_factory.mktemp("oom-train")
    counter = Once(1)
    real = _SlimTrainer.training_step

    def step(self, model, inputs, num_items_in_batch=None):
        if self.state.global_step == 1 and counter():
            raise oom("packed_sft step 2")
        return real(self, model, inputs, num_items_in_batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_SlimTrainer, "training_step", step)
        summary = run_finetune(spec_dict(out))
    return {"run_dir": out / "faults", "summary": summary, "counter": counter}


def _record(run_dir, stage: str) -> dict:
    return json.loads((run_dir / "memory" / f"{stage}.json").read_text())


def _check_retried(run: dict, stage: str, fired: bool, observe) -> dict:
    record = _record(run["run_dir"], stage)
    assert fired, f"the OOM injected into {stage} never fired"
    assert record["attempts"] == 2 and record["outcome"] == "completed", record
    observe(f"attempt 2 completed; downshifts: {record['downshifts'] or 'none'}")
    return record


_SAME_BYTES = "retried once; final adapter, merged shards and GGUF byte-identical to a clean run"


@pytest.mark.fault("Out of memory", stage="load_4bit", expect=_SAME_BYTES)
def test_oom_load_4bit(five_stage_oom, reference_run, observe):
    _check_retried(five_stage_oom, "load_4bit", five_stage_oom["counters"]["load_4bit"].fired, observe)
    got, ref = five_stage_oom["run_dir"], reference_run["run_dir"]
    assert sha256(got / "adapter/adapter_model.safetensors") == sha256(ref / "adapter/adapter_model.safetensors")


@pytest.mark.fault("Out of memory", stage="attach_lora", expect=_SAME_BYTES)
def test_oom_attach_lora(five_stage_oom, reference_run, observe):
    _check_retried(five_stage_oom, "attach_lora", five_stage_oom["counters"]["attach_lora"].fired, observe)
    got, ref = five_stage_oom["run_dir"], reference_run["run_dir"]
    # peft injects LoRA into the base model in place: a retry must not stack a second adapter on the first
    cfg = json.loads((got / "adapter/adapter_config.json").read_text())
    ref_cfg = json.loads((ref / "adapter/adapter_config.json").read_text())
    assert cfg["target_modules"] == ref_cfg["target_modules"]
    assert (
        five_stage_oom["summary"]["attach_lora"]["trainable_parameters"]
        == reference_run["summary"]["attach_lora"]["trainable_parameters"]
    )
    assert sha256(got / "adapter/adapter_model.safetensors") == sha256(ref / "adapter/adapter_model.safetensors")


@pytest.mark.fault(
    "Out of memory",
    stage="packed_sft",
    expect="retried with half the micro-batch; adapter equal to a clean run within 2e-2 (fp32 summation order)",
)
def test_oom_packed_sft(train_oom, reference_run, observe):
    record = _check_retried(train_oom, "packed_sft", train_oom["counter"].fired, observe)
    assert any("micro-batch 4 -> 2" in d for d in record["downshifts"]), record["downshifts"]
    trained = train_oom["summary"]["packed_sft"]
    assert trained["steps"] == 4 and trained["micro_batch_size"] == 2
    assert trained["gradient_accumulation_steps"] == 2
    worst, rel = adapter_diff(train_oom["run_dir"] / "adapter", reference_run["run_dir"] / "adapter")
    observe(f"adapter vs clean run: max |diff| {worst:.2e}, relative L2 {rel:.2e}")
    # Not bytes: the downshifted micro-batch sums the same gradients in another order (see _TRAIN_RTOL).
    assert rel < TRAIN_RTOL, f"adapter differs from the clean run by {rel:.3e} (relative L2)"


@pytest.mark.fault("Out of memory", stage="cleanup", expect="retried once; the flow completes")
def test_oom_cleanup(tmp_path, prefect_harness, observe):
    # The stage's wiring is the fault here, so the model stages are stubbed (cleanup itself stays real).
    counter = Once(1)
    with pytest.MonkeyPatch.context() as mp:
        stub_model_stages(mp)
        mp.setattr(cleanup_mod, "clean_memory", _raise_on(counter, "cleanup", cleanup_mod.clean_memory))
        try:
            run_finetune(spec_dict(tmp_path, **WIRING_ONLY))
        except MemoryPressure as e:
            observe(f"flow failed: {str(e).split(';')[0]}")
            raise
    record = _check_retried({"run_dir": tmp_path / "faults"}, "cleanup", counter.fired, observe)
    assert record["attempts"] == 2


@pytest.mark.fault(
    "Out of memory",
    stage="dequant_merge",
    expect="retried with maximum_memory_usage 0.1 lower; merged shards byte-identical; no temporary folder left",
)
def test_oom_dequant_merge(five_stage_oom, reference_run, observe):
    record = _check_retried(five_stage_oom, "dequant_merge", five_stage_oom["counters"]["dequant_merge"].fired, observe)
    assert any("0.90 -> 0.80" in d for d in record["downshifts"]), record["downshifts"]
    got, ref = five_stage_oom["run_dir"], reference_run["run_dir"]
    shards = sorted(p.name for p in (ref / "merged").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (got / "merged").glob("*.safetensors"))
    for name in shards:
        assert sha256(got / "merged" / name) == sha256(ref / "merged" / name), name
    assert not list(got.glob(".merged*")), list(got.glob(".merged*"))


@pytest.mark.fault(
    "Out of memory", stage="gguf_convert_and_push", expect="retried; GGUF byte-identical; no temporary file left"
)
def test_oom_gguf(five_stage_oom, reference_run, observe):
    _check_retried(
        five_stage_oom, "gguf_convert_and_push", five_stage_oom["counters"]["gguf_convert_and_push"].fired, observe
    )
    got, ref = five_stage_oom["run_dir"] / "gguf", reference_run["run_dir"] / "gguf"
    assert sha256(got / "faults-f16.gguf") == sha256(ref / "faults-f16.gguf")
    assert not [p.name for p in got.iterdir() if p.name.startswith(".")]
