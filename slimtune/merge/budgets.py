"""Budgets, the output shard plan and the disk preflight: all decided before the first byte is written."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from slimtune.merge.errors import DiskSpaceError
from slimtune.merge.safetensors_io import TensorEntry
from slimtune.spec.schema import MERGE_MEMORY_USAGE_MAX

_DISK_SLACK = 64 * 1024**2  # headers, index, config, tokenizer and filesystem metadata


@dataclass(frozen=True)
class Budgets:
    """Bytes the merge may use: GPU for one tensor's fp32 working set, host RAM for finished tensors."""

    device: str
    gpu_bytes: int
    host_bytes: int


def resolve_budgets(
    maximum_memory_usage: float, device: str | None, gpu_budget_bytes: int | None, host_budget_bytes: int | None
) -> Budgets:
    """Apply `maximum_memory_usage` to free GPU memory and available host memory; explicit bytes win."""
    if not 0 < maximum_memory_usage <= MERGE_MEMORY_USAGE_MAX:
        raise ValueError(
            f"merge.maximum_memory_usage={maximum_memory_usage}: must be in (0, {MERGE_MEMORY_USAGE_MAX}]; the "
            "rest is headroom for the CUDA context, allocator fragmentation and other processes"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = 0
    if device.startswith("cuda"):
        gpu = (
            gpu_budget_bytes
            if gpu_budget_bytes is not None
            else int(torch.cuda.mem_get_info(torch.device(device))[0] * maximum_memory_usage)
        )
    host = (
        host_budget_bytes
        if host_budget_bytes is not None
        else int(psutil.virtual_memory().available * maximum_memory_usage)
    )
    return Budgets(device, gpu, host)


def gpu_working_set(entry: TensorEntry, out_itemsize: int, quantized: bool) -> int:
    """Peak GPU bytes to merge `entry`: stored W + its NF4 round trip + W fp32 + delta fp32 + output."""
    n = entry.numel
    stored = entry.nbytes
    nf4 = (stored + n // 2 + n // 16) if quantized else 0  # dequantized copy + packed 4-bit + statistics
    return stored + nf4 + 8 * n + n * out_itemsize


@dataclass(frozen=True)
class OutputShard:
    """One output file and the base tensors (in read order) that go into it."""

    filename: str
    entries: tuple[TensorEntry, ...]
    nbytes: int


def plan_shards(entries: list[TensorEntry], out_nbytes: dict[str, int], max_shard_bytes: int) -> list[OutputShard]:
    """Pack tensors greedily, in base read order, into shards of at most `max_shard_bytes` (a bigger tensor
    gets a shard of its own), named as transformers names them."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be positive")
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + out_nbytes[e.name] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += out_nbytes[e.name]
    n = len(groups)
    return [
        OutputShard(f"model-{i:05d}-of-{n:05d}.safetensors", tuple(g), sum(out_nbytes[e.name] for e in g))
        for i, g in enumerate(groups, 1)
    ]


def spill_bound(shards: list[OutputShard], host_bytes: int) -> int:
    """Most bytes ever spilled at once: at most two shards are held (one being written, the next being
    merged) and spill files are deleted once written, so nothing when those two fit the host budget."""
    two = sum(sorted(s.nbytes for s in shards)[-2:])
    return two if two > host_bytes else 0


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def preflight_disk(out_parent: Path, out_bytes: int, spill_dir: Path, spill_bytes: int) -> None:
    """Fail before any work when the output or spill filesystem lacks room (summed when they coincide)."""
    out_fs, spill_fs = _existing(out_parent), _existing(spill_dir)
    needs: dict[Path, tuple[int, list[str]]] = {out_fs: (out_bytes + _DISK_SLACK, ["the merged output"])}
    if spill_bytes:
        same = os.stat(out_fs).st_dev == os.stat(spill_fs).st_dev
        key = out_fs if same else spill_fs
        need, what = needs.get(key, (_DISK_SLACK, []))
        needs[key] = (need + spill_bytes, [*what, f"{spill_bytes / 1024**3:.2f} GiB of spill files"])
    for path, (need, what) in needs.items():
        free = shutil.disk_usage(path).free
        if free < need:
            raise DiskSpaceError(
                f"not enough disk space at {path} for {' and '.join(what)}: need {need / 1024**3:.2f} GiB "
                f"({need} bytes), free {free / 1024**3:.2f} GiB ({free} bytes). Free space there, choose "
                "another output dir, or set merge.temporary_location to a larger disk (a larger host budget "
                "avoids spill)"
            )
