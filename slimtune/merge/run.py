"""`merge_adapter`: validate, hash, reuse or plan, preflight, merge tensor by tensor, publish atomically."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from slimtune.core import atomic
from slimtune.memory.sampler import PeakSampler
from slimtune.merge.budgets import OutputShard, plan_shards, preflight_disk, resolve_budgets, spill_bound
from slimtune.models.multimodal import checkpoint_names, copied_keys, layout_of
from slimtune.models.source import config_dtype

from .errors import AlreadyMergedError, MergeError
from .fused_experts import stack_fused_experts
from .lora_delta import ADAPTER_FILES, check_against_base, load_adapter
from .manifest import MANIFEST, MARKER, adapter_digest, hash_files, read_manifest, reusable, write_manifest
from .mxfp4_stored import split_mxfp4
from .nf4 import QuantSpec, quantized_tensor_names
from .prequantized import is_prequantized, split_stored_4bit
from .safetensors_io import DTYPES, FLOAT16_32, INDEX, TensorEntry, checkpoint_shards, read_entries
from .stream import HeldTensors, TensorMerger, merge_shards

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
_DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class MergeReport:
    """What a merge did, JSON-able for Prefect artifacts and benchmarks (`to_dict`)."""

    out_dir: str
    source_used: str
    reused: bool
    output_dtype: str
    tensors_merged: int = 0  # LoRA deltas added
    tensors_dequantized: int = 0  # NF4 round trip only (quantized linears the adapter does not target)
    tensors_replaced: int = 0  # modules_to_save copies
    tensors_copied: int = 0
    tensors_spilled: int = 0
    bytes_spilled: int = 0
    bytes_written: int = 0
    shards: int = 0
    gpu_budget_bytes: int = 0
    host_budget_bytes: int = 0
    peak_gpu_allocated_bytes: int = 0  # above what was allocated when the merge started
    peak_host_held_bytes: int = 0  # finished tensors held in RAM (the budgeted quantity)
    peak_host_rss_bytes: int = 0  # whole process, sampled
    seconds: float = 0.0
    devices: dict[str, int] = field(default_factory=dict)  # tensors merged per device
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase

    def to_dict(self) -> dict:
        return asdict(self)


def _base_checkpoint(base_dir: Path) -> tuple[list[Path], list[TensorEntry]]:
    shards = checkpoint_shards(base_dir)
    if not shards:
        raise MergeError(
            f"{base_dir} holds no safetensors weights; merge needs the base model's safetensors "
            "shards (convert .bin checkpoints with save_pretrained(safe_serialization=True))"
        )
    entries = [e for s in shards for e in read_entries(s)]
    return shards, entries


def _copied_files(base_dir: Path) -> list[Path]:
    """Tokenizer, generation config and other small files that travel with the weights."""
    skip = (INDEX, "config.json", MANIFEST)
    return sorted(
        p
        for p in base_dir.iterdir()
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name not in skip
    )


def _output_dtype(config: dict, entries: list[TensorEntry], requested: torch.dtype | None) -> torch.dtype:
    if requested is not None:
        if requested not in _DTYPE_NAMES.values():
            raise ValueError(f"output_dtype {requested}: use torch.bfloat16, torch.float16 or torch.float32")
        return requested
    if (named := config_dtype(config)) is not None:
        return _DTYPE_NAMES[named]
    stored = [e.dtype for e in entries if e.dtype in FLOAT16_32]
    return DTYPES[max(set(stored), key=stored.count)]


def _resolve_source(source: str, prequantized: bool, entries: list[TensorEntry], base_dir: Path) -> str:
    """`auto` is `original` on 16-bit shards and `dequantized` (the stored NF4) on a 4-bit checkpoint."""
    if source not in ("dequantized", "original", "auto"):
        raise ValueError(f"merge.source={source!r}: use 'dequantized', 'original' or 'auto'")
    if prequantized:
        if source == "original":
            raise MergeError(
                f"{base_dir} is a 4-bit bitsandbytes checkpoint without 16-bit shards; use "
                "merge.source 'dequantized' or 'auto', or pass the 16-bit base model directory"
            )
        return "dequantized"
    odd = sorted({e.dtype for e in entries if e.name.endswith(".weight") and e.dtype not in FLOAT16_32})
    if odd:
        raise MergeError(
            f"{base_dir} stores weights as {', '.join(odd)}; merging needs 16-bit (or fp32) "
            "shards or a bitsandbytes 4-bit checkpoint"
        )
    return "original" if source == "auto" else source


def merge_adapter(
    base_dir: Path,
    adapter_dir: Path,
    out_dir: Path,
    *,
    source: Literal["dequantized", "original", "auto"] = "auto",
    maximum_memory_usage: float = 0.9,
    temporary_location: Path | None = None,
    output_dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    device: str | None = None,
    gpu_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    quant: dict | None = None,
) -> MergeReport:
    """Merge a peft LoRA adapter into a 16-bit base, one tensor at a time, within GPU and host budgets.

    Refuses (before writing anything) a base that is already a merge output, an adapter that does not fit the
    base, and a disk without room for output plus spill. Reuses `out_dir` when its manifest shows the same
    inputs and its files verify. See slimtune/merge/__init__.py for the design.
    """
    start = time.perf_counter()
    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir).absolute()
    config = json.loads((base_dir / "config.json").read_text())
    if MARKER in config:
        raise AlreadyMergedError(
            f"{base_dir} is already a merged model ({MARKER} in config.json: "
            f"{config[MARKER]}); merging again would apply the adapter twice. Use the "
            "original base model as base_dir"
        )
    shards_in, entries = _base_checkpoint(base_dir)
    prequantized = is_prequantized(config)
    entries, stored_4bit = split_stored_4bit(entries) if prequantized else (entries, {})
    entries, mxfp4 = split_mxfp4(entries)  # gpt-oss's released experts: merged onto their bf16 dequantization
    stored_4bit |= mxfp4
    # a multimodal checkpoint's language model was trained alone: its names -> the checkpoint's keys; every other
    # tensor (vision tower, projector, mtp) is copied through as stored
    names = checkpoint_names(e.name for e in entries) if layout_of(config) is not None else {}
    kept = frozenset(copied_keys(config, (e.name for e in entries)))
    adapter = stack_fused_experts(load_adapter(adapter_dir).renamed(names), {e.name: e for e in entries})
    check_against_base(adapter, {e.name: e for e in entries})
    source_used = _resolve_source(source, prequantized, entries, base_dir)
    out_dtype = _output_dtype(config, entries, output_dtype)
    # a 4-bit checkpoint is dequantized as stored; a 16-bit one is quantized as bitsandbytes would have
    qspec = QuantSpec.from_dict(quant) if source_used == "dequantized" and not prequantized else None
    budgets = resolve_budgets(maximum_memory_usage, device, gpu_budget_bytes, host_budget_bytes)
    if out_dir in (base_dir.absolute(), adapter_dir.absolute()):
        raise MergeError(f"out_dir {out_dir} is the base or adapter directory; choose a new output dir")
    if out_dir.is_dir() and read_manifest(out_dir) is None and any(out_dir.iterdir()):
        raise MergeError(
            f"out_dir {out_dir} exists and is not a slimtune merge output; remove it or choose another output dir"
        )

    timings = {"validate": time.perf_counter() - start}
    copied = _copied_files(base_dir)
    base_inputs = [
        *shards_in,
        *([base_dir / INDEX] if (base_dir / INDEX).is_file() else []),
        base_dir / "config.json",
        *copied,
    ]
    inputs = hash_files(
        {**{f"base/{p.name}": p for p in base_inputs}, **{f"adapter/{n}": adapter_dir / n for n in ADAPTER_FILES}}
    )
    timings["hash_inputs"] = time.perf_counter() - start - sum(timings.values())
    params = {
        "source": source_used,
        "output_dtype": str(out_dtype).removeprefix("torch."),
        "quant": qspec.as_json() if qspec else None,
        "max_shard_bytes": max_shard_bytes,
    }
    report = MergeReport(
        str(out_dir),
        source_used,
        False,
        params["output_dtype"],
        gpu_budget_bytes=budgets.gpu_bytes,
        host_budget_bytes=budgets.host_bytes,
    )
    if out_dir.exists() and reusable(out_dir, inputs, params):
        report.reused, report.seconds = True, time.perf_counter() - start
        report.timings = {k: round(v, 3) for k, v in timings.items()}
        return report

    quantized = {names.get(n, n) for n in quantized_tensor_names(base_dir, qspec)} if qspec else set()
    merger = TensorMerger(adapter, quantized, qspec, out_dtype, budgets, stored_4bit, kept)
    shards = plan_shards(entries, {e.name: merger.out_nbytes(e) for e in entries}, max_shard_bytes)
    out_bytes = sum(s.nbytes for s in shards) + sum(p.stat().st_size for p in copied)
    spill = spill_bound(shards, budgets.host_bytes)
    temporary_location = Path(temporary_location) if temporary_location else out_dir.parent
    preflight_disk(out_dir.parent, out_bytes, temporary_location, spill)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    atomic.sweep_leftovers(out_dir.parent, out_dir.name)  # a merge killed earlier left its temporaries
    tmp = atomic.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent)
    held = HeldTensors(budgets.host_bytes, temporary_location)
    cuda = budgets.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(budgets.device)
        gpu_base = torch.cuda.memory_allocated(budgets.device)
    try:
        with PeakSampler("cpu", interval_s=0.02) as rss:  # host peaks last milliseconds
            mark = time.perf_counter()
            outputs = merge_shards(shards, merger, held, tmp, out_bytes + spill)
            timings["merge_and_write"] = time.perf_counter() - mark
            _write_metadata(
                tmp,
                shards,
                config,
                out_dtype,
                copied,
                {
                    "adapter_sha256": adapter_digest({k: v for k, v in inputs.items() if k.startswith("adapter/")}),
                    "source": source_used,
                },
            )
            outputs.update(hash_files({p.name: p for p in tmp.iterdir() if p.name not in outputs}))
            write_manifest(tmp, inputs, params, outputs)
            atomic.replace_dir(tmp, out_dir)
    finally:
        held.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if cuda:
        report.peak_gpu_allocated_bytes = torch.cuda.max_memory_allocated(budgets.device) - gpu_base
    written = sum((out_dir / n).stat().st_size for n in [*outputs, MANIFEST])
    _fill_report(report, merger, held, len(shards), written)
    report.peak_host_rss_bytes = rss.peak_host_rss
    report.seconds = time.perf_counter() - start
    timings["other"] = report.seconds - sum(timings.values())  # reuse check, plan, metadata, rename
    report.timings = {k: round(v, 3) for k, v in timings.items()}
    return report


def _fill_report(report: MergeReport, merger: TensorMerger, held: HeldTensors, shards: int, bytes_written: int) -> None:
    """Copy the merge's counters into the report."""
    report.tensors_merged = merger.counts["merged"]
    report.tensors_dequantized = merger.counts["dequantized_only"]
    report.tensors_replaced = merger.counts["replaced"]
    report.tensors_copied = merger.counts["copied"]
    report.tensors_spilled, report.bytes_spilled = held.spilled_count, held.spilled_bytes
    report.peak_host_held_bytes = held.peak
    report.devices = dict(merger.devices)
    report.shards, report.bytes_written = shards, bytes_written


def _write_metadata(
    tmp: Path, shards: list[OutputShard], config: dict, out_dtype: torch.dtype, copied: list[Path], marker: dict
) -> None:
    """Index, config (dtype updated, merged marker added) and the tokenizer/generation files."""
    weight_map = {e.name: s.filename for s in shards for e in s.entries}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX).write_text(json.dumps(index, indent=2))
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["dtype"] = str(out_dtype).removeprefix("torch.")
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    config[MARKER] = marker
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for p in copied:
        shutil.copyfile(p, tmp / p.name)
