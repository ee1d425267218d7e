"""The tensor-by-tensor merge: read one base tensor, add its LoRA delta on the GPU (or the CPU when its
fp32 working set exceeds the GPU budget), hold the result until its shard is written, spilling past the host
budget.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

from slimtune.merge.budgets import Budgets, OutputShard, gpu_working_set

from .errors import DiskSpaceError
from .lora_delta import Adapter
from .nf4 import QuantSpec, roundtrip
from .prequantized import dequantize_stored
from .safetensors_io import DTYPES, FLOAT16_32, NAMES, OutTensor, TensorEntry, as_tensor, read_raw, write_shard


class HeldTensors:
    """Finished tensors waiting for their shard: in RAM up to `budget` bytes, beyond that in files under
    `temporary_location`, memory-mapped back one at a time as the shard is written and deleted right after.
    Filled by the merging thread and drained by the writer thread, hence the lock."""

    def __init__(self, budget: int, temporary_location: Path) -> None:
        self.budget = budget
        self._location = temporary_location
        self._dir: Path | None = None
        self._ram: dict[str, torch.Tensor] = {}
        self._spilled: dict[str, Path] = {}
        self.held = self.peak = self.spilled_count = self.spilled_bytes = 0
        self._lock = threading.Lock()

    def put(self, name: str, raw: torch.Tensor) -> None:
        """Keep `raw` (uint8, CPU) in RAM if it fits the budget, else write it to a spill file."""
        with self._lock:
            if self.held + raw.numel() <= self.budget:
                self._ram[name] = raw
                self.held += raw.numel()
                self.peak = max(self.peak, self.held)
                return
            if self._dir is None:
                self._location.mkdir(parents=True, exist_ok=True)
                self._dir = Path(tempfile.mkdtemp(prefix=".slimtune-spill-", dir=self._location))
            path = self._dir / f"{self.spilled_count:06d}.bin"
            self.spilled_count += 1
            self.spilled_bytes += raw.numel()
        try:
            with open(path, "wb") as f:
                f.write(memoryview(raw.numpy()))
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DiskSpaceError(
                    f"disk full while spilling {name} ({raw.numel()} bytes) to {path}; set "
                    "merge.temporary_location to a disk with more room or raise the host "
                    "budget (merge.maximum_memory_usage)"
                ) from e
            raise
        with self._lock:
            self._spilled[name] = path

    def chunks(self, name: str) -> Iterator[memoryview]:
        """Yield a tensor's bytes once and release them (RAM freed, spill file unmapped and deleted)."""
        with self._lock:
            raw = self._ram.pop(name, None)
            path = None if raw is not None else self._spilled.pop(name)
        if raw is not None:
            nbytes = raw.numel()
            yield memoryview(raw.numpy())
            del raw  # counted as held until written: the writer's view keeps it alive until here
            with self._lock:
                self.held -= nbytes
            return
        if path.stat().st_size:
            mapped = np.memmap(path, dtype=np.uint8, mode="r")
            yield memoryview(mapped)
            del mapped
        path.unlink()

    def close(self) -> None:
        """Remove the spill directory (also after a failure)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class TensorMerger:
    """Produces each output tensor's bytes: LoRA merge, NF4 round trip, modules_to_save copy or plain copy."""

    def __init__(
        self,
        adapter: Adapter,
        quantized: set[str],
        quant: QuantSpec | None,
        out_dtype: torch.dtype,
        budgets: Budgets,
        stored_4bit: dict[str, dict[str, TensorEntry]],
        kept: frozenset[str],
    ) -> None:
        self.adapter, self.quantized, self.quant = adapter, quantized, quant
        self.kept = kept  # copied byte for byte in their stored dtype (a multimodal checkpoint's vision weights)
        self.stored_4bit = stored_4bit
        self.out_dtype, self.budgets = out_dtype, budgets
        self._staging: torch.Tensor | None = None  # one pinned buffer: pinned H2D runs ~3x pageable
        self.devices: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()

    def out_dtype_name(self, entry: TensorEntry) -> str:
        """Floating tensors take the output dtype; integer buffers and kept tensors keep theirs."""
        return NAMES[self.out_dtype] if entry.dtype in FLOAT16_32 and entry.name not in self.kept else entry.dtype

    def out_nbytes(self, entry: TensorEntry) -> int:
        return entry.numel * DTYPES[self.out_dtype_name(entry)].itemsize

    def _cast(self, t: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        return t.to(DTYPES[self.out_dtype_name(entry)]).contiguous().reshape(-1).view(torch.uint8)

    def merged_raw(self, entry: TensorEntry) -> torch.Tensor:
        """The output bytes of `entry` as a CPU uint8 tensor."""
        if entry.name in self.adapter.replacements:
            self.counts["replaced"] += 1
            return self._cast(self.adapter.replacements[entry.name], entry)
        factor = self.adapter.lora.get(entry.name)
        quantize = entry.name in self.quantized
        stored = self.stored_4bit.get(entry.name)
        if factor is None and not quantize and stored is None:
            self.counts["copied"] += 1
            raw = read_raw(entry)
            if self.out_dtype_name(entry) == entry.dtype:
                return raw
            return self._cast(as_tensor(raw, entry.dtype, entry.shape), entry)
        fits = gpu_working_set(entry, self.out_dtype.itemsize, quantize or stored is not None) <= self.budgets.gpu_bytes
        device = self.budgets.device if fits else "cpu"
        self.devices[device] += 1
        self.counts["merged" if factor is not None else "dequantized_only"] += 1
        if stored is not None:
            w = dequantize_stored(stored, device)
        elif device == "cpu":
            w = as_tensor(read_raw(entry), entry.dtype, entry.shape)
        else:
            if self._staging is None or self._staging.numel() < entry.nbytes:
                self._staging = None
                self._staging = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
            w = as_tensor(read_raw(entry, self._staging), entry.dtype, entry.shape)
            w = w.to(device, non_blocking=True)
        if quantize:
            w = roundtrip(w, self.quant)
        w32 = w.float()  # a fresh buffer or our own read buffer, so the in-place add below is safe
        del w
        if factor is not None:
            delta = factor.delta(device)
            w32.add_(delta)
            del delta
        out = self._cast(w32, entry)
        del w32
        return out.cpu()


def merge_shards(
    shards: list[OutputShard], merger: TensorMerger, held: HeldTensors, out_dir: Path, space_needed: int
) -> dict[str, str]:
    """Merge and write every shard into `out_dir`; returns {filename: sha256}.

    One writer thread writes shard k (disk, sha256, fsync; all release the GIL) while shard k+1 is merged,
    so the GPU and the disk work at once; both shards count against the host budget through `held`.
    """
    hashes: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimtune-shard-writer") as writer:
        pending: Future | None = None
        for shard in shards:
            for entry in shard.entries:
                held.put(entry.name, merger.merged_raw(entry))
                if pending is not None and pending.done():
                    hashes.update(pending.result())  # surface a writer error (disk full) early
                    pending = None
            if pending is not None:
                hashes.update(pending.result())
            tensors = [
                OutTensor(e.name, merger.out_dtype_name(e), e.shape, merger.out_nbytes(e), partial(held.chunks, e.name))
                for e in shard.entries
            ]
            pending = writer.submit(
                lambda s=shard, t=tensors: {s.filename: write_shard(out_dir / s.filename, t, space_needed)}
            )
        if pending is not None:
            hashes.update(pending.result())
    return hashes
