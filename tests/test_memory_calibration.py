"""The estimator against GPU measurements: every measured cell within [1.0, 1.15] x measured.

The table is benchmarks/results/memory/h100-2026-11-22.json, written by benchmarks/calibrate_memory.py
through the device tool on an H100: the real load_4bit / packed_sft / dequant_merge / export code, 1B,
8B (Llama) and 7B (Qwen2) shapes. GPU: device-wide used memory (CUDA context and workspaces included).
Host: RSS while training (pinned offload buffers are real memory), anonymous RSS while loading, merging
and exporting (shards and GGUF files are mapped: file-backed pages the kernel can drop).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimtune.kernels.apply import expected_kernels
from slimtune.memory.estimate import estimate_export, estimate_load_4bit, estimate_merge, estimate_train

TABLE = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "memory" / "h100-2026-11-22.json"
BAND = (1.0, 1.15)
_GIB = 1024**3


def _table() -> dict:
    return json.loads(TABLE.read_text())


def _measured(stage: str) -> list[dict]:
    return [r for r in _table()["grid"] if r.get("stage") == stage and r.get("outcome") == "completed"]


def _id(row: dict) -> str:
    return f"{row['model']}-{row['kernels']}-{row.get('micro_batch')}x{row.get('seq_len')}-{row.get('checkpointing')}"


def _train(cfg: dict, micro_batch: int, seq_len: int, checkpointing, kernels) -> object:
    return estimate_train(
        cfg,
        micro_batch=micro_batch,
        seq_len=seq_len,
        lora_r=16,
        target_modules="all-linear",
        checkpointing=checkpointing,
        kernels=kernels,
    )


def _in_band(estimate: int, measured: int) -> bool:
    return BAND[0] <= estimate / measured <= BAND[1]


def test_the_table_covers_the_grid_the_issue_names():
    cells = {
        (r["model"], r["kernels"], r["micro_batch"], r["seq_len"], str(r["checkpointing"]))
        for r in _measured("packed_sft")
    }
    for model in ("1b", "8b", "qwen7b"):
        assert (model, "auto", 4, 2048, "unsloth") in cells
    assert {c[4] for c in cells} == {"False", "True", "unsloth"}
    assert {c[3] for c in cells} == {2048, 8192}
    assert {c[1] for c in cells} == {"auto", "off"}
    assert len(cells) >= 40


@pytest.mark.parametrize("row", _measured("packed_sft"), ids=_id)
def test_train_gpu_estimate_holds_every_measured_cell(row):
    est = _train(row["config"], row["micro_batch"], row["seq_len"], row["checkpointing"], row["applied_kernels"])
    assert _in_band(est.gpu_bytes, row["peak_device_used"]), (est.gpu_bytes / row["peak_device_used"], est.breakdown)
    # The weights are counted once: as resident, which preflight subtracts when they are already here.
    assert est.resident_gpu_bytes < est.gpu_bytes and est.context_gpu_bytes > 0


@pytest.mark.parametrize("row", _measured("load_4bit"), ids=_id)
def test_load_estimate_holds_gpu_and_anonymous_host_memory(row):
    est = estimate_load_4bit(row["config"], compute_dtype_bytes=2)
    assert _in_band(est.gpu_bytes, row["peak_device_used"]), est.gpu_bytes / row["peak_device_used"]
    assert _in_band(est.host_bytes, row["peak_host_anon"]), est.host_bytes / row["peak_host_anon"]
    # The loader maps the shards: RSS counts them, but they are file-backed (not what the host must hold).
    assert row["peak_host_rss"] > 2 * row["peak_host_anon"]


def _e2e_runs() -> list[dict]:
    return [e for e in _table()["e2e"] if e.get("stages")]


def _config_8b() -> dict:
    return next(r["config"] for r in _table()["grid"] if r["model"] == "8b")


@pytest.mark.parametrize("run", _e2e_runs(), ids=lambda e: e["run"])
def test_end_to_end_stages_hold_gpu_and_host(run):
    """`slimtune run` on the 8B shape: each completed stage's estimate against its guard record."""
    cfg = _config_8b()
    stages = run["stages"]
    checked = 0
    kernels = expected_kernels("auto", "cuda", "llama")
    load = estimate_load_4bit(cfg, compute_dtype_bytes=2)
    assert _in_band(load.gpu_bytes, stages["load_4bit"]["peak_device_used"])
    assert _in_band(load.host_bytes, stages["load_4bit"]["peak_host_anon"])
    if stages["packed_sft"]["outcome"] == "completed":
        mb = run["train"]["micro_batch_size"]
        est = _train(cfg, mb, 2048, run["checkpointing"], kernels)
        rec = stages["packed_sft"]
        assert _in_band(est.gpu_bytes, rec["peak_device_used"]), est.gpu_bytes / rec["peak_device_used"]
        assert _in_band(est.host_bytes, rec["peak_host_rss"]), est.host_bytes / rec["peak_host_rss"]
        checked += 1
    if "dequant_merge" in stages:
        est = estimate_merge(cfg, max_shard_bytes=int(2e9), output_dtype_bytes=2)
        rec = stages["dequant_merge"]
        assert _in_band(est.gpu_bytes, rec["peak_device_used"]), est.gpu_bytes / rec["peak_device_used"]
        assert _in_band(est.host_bytes, rec["peak_host_anon"]), est.host_bytes / rec["peak_host_anon"]
        exp = estimate_export(cfg, out_types=["f16"])
        assert _in_band(exp.host_bytes, stages["gguf_convert_and_push"]["peak_host_anon"])
        checked += 1
    # The whole 8B flow stays under 8 GiB of anonymous host memory.
    assert max(r["peak_host_anon"] for r in stages.values()) <= 8 * _GIB
    assert checked or stages["packed_sft"]["outcome"] == "preflight failed"


def test_the_6_gib_refusal_is_right_and_7_gib_fits():
    """At 6 GiB the preflight refused 8B at 1 x 2048 "unsloth"; the allocator peak measured for that very
    cell (grid, same kernels) is above 6 GiB, so the run would have run out of memory."""
    runs = {e["run"]: e for e in _e2e_runs()}
    refused, ran = runs["e2e-8b-6gib-mb1"], runs["e2e-8b-7gib-mb1"]
    assert refused["rc"] != 0 and refused["stages"]["packed_sft"]["outcome"] == "preflight failed"
    assert ran["rc"] == 0
    cell = next(
        r
        for r in _measured("packed_sft")
        if r["model"] == "8b"
        and r["kernels"] == "auto"
        and (r["micro_batch"], r["seq_len"], r["checkpointing"]) == (1, 2048, "unsloth")
    )
    budget = refused["fraction"] * cell["total"]
    assert cell["peak_reserved"] > budget
    est = _train(_config_8b(), 1, 2048, "unsloth", expected_kernels("auto", "cuda", "llama"))
    assert est.gpu_bytes - est.context_gpu_bytes > budget
    assert est.gpu_bytes - est.context_gpu_bytes <= ran["fraction"] * cell["total"]


def test_auto_chose_the_largest_micro_batch_that_fits_and_did_not_run_out():
    run = {e["run"]: e for e in _e2e_runs()}["e2e-8b-16gib-mbauto"]
    cfg, kernels = _config_8b(), expected_kernels("auto", "cuda", "llama")
    budget = run["fraction"] * next(r["total"] for r in _table()["grid"] if r["model"] == "8b")
    chosen = run["train"]["micro_batch_size"]
    assert run["rc"] == 0 and chosen * run["train"]["gradient_accumulation_steps"] == 16

    def allocator(mb: int) -> int:
        est = _train(cfg, mb, 2048, "unsloth", kernels)
        return est.gpu_bytes - est.context_gpu_bytes

    assert chosen == 16 and allocator(chosen) <= budget  # 16 is the largest divisor of the effective batch
    assert run["stages"]["packed_sft"]["peak_gpu_reserved"] <= budget
    # At a 7 GiB budget the same rule keeps only micro-batch 1 and 2 of 16's divisors out of reach above 1.
    small = run["fraction"] * 7 / 16 * next(r["total"] for r in _table()["grid"] if r["model"] == "8b")
    assert allocator(1) <= small < allocator(2)
