"""Read single tensors from safetensors shards and stream shards out, without mmap and without a full copy.

The safetensors library maps whole shards (every page read stays in our RSS until the file closes) and its
`save_file` copies a shard's tensors into one bytes object first (2x the shard in RAM). Merging 16 GB inside
an 8 GiB host budget needs neither: the format is an 8-byte header length, a JSON header, then raw bytes,
so tensors are read with plain `readinto` (page cache, not RSS) and written as they are produced.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import DiskSpaceError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT16_32 = ("F16", "BF16", "F32")  # the dtypes a mergeable 16-bit (or fp32) checkpoint is stored in
INDEX = "model.safetensors.index.json"
_CHUNK = 64 * 1024**2  # write granularity: large enough for sequential disk throughput, small for RSS


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a shard: absolute byte range [start, end) in `file`."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_entries(path: Path) -> list[TensorEntry]:
    """Parse a shard's header into entries, ordered by position in the file (sequential reads)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    entries = [
        TensorEntry(
            name,
            path,
            meta["dtype"],
            tuple(meta["shape"]),
            base + meta["data_offsets"][0],
            base + meta["data_offsets"][1],
        )
        for name, meta in header.items()
        if name != "__metadata__"
    ]
    return sorted(entries, key=lambda e: e.start)


def checkpoint_shards(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names (a folder may hold others, as Mistral's
    `consolidated.safetensors` beside the shards), else every one in the folder. The merge reads these; `plan`
    and load_4bit count the same tensors."""
    index = model_dir / INDEX
    if index.is_file():
        return [model_dir / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    return sorted(model_dir.glob("*.safetensors"))


def read_raw(entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read a tensor's bytes into `out` (e.g. a pinned staging buffer) or a fresh uint8 tensor."""
    buf = torch.empty(entry.nbytes, dtype=torch.uint8) if out is None else out[: entry.nbytes]
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start)
        view = memoryview(buf.numpy())
        done = 0
        while done < entry.nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{entry.file} is truncated: tensor {entry.name} ends at byte {entry.end}")
            done += n
    return buf


def as_tensor(raw: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """View raw little-endian bytes as the stored dtype and shape (no copy)."""
    return raw.view(DTYPES[dtype]).reshape(shape)


@dataclass(frozen=True)
class OutTensor:
    """One tensor of an output shard: its header fields and a callable yielding its bytes when written."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: Callable[[], Iterable[memoryview]]


def write_shard(path: Path, tensors: list[OutTensor], space_needed: int) -> str:
    """Stream `tensors` into a safetensors file at `path`, fsync it, and return its sha256.

    `space_needed` only goes into the disk-full message, so the user learns how much room to make.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data section to 8 bytes
    digest = hashlib.sha256()
    try:
        with open(path, "wb") as f:
            for piece in (struct.pack("<Q", len(blob)), blob):
                f.write(piece)
                digest.update(piece)
            for t in tensors:
                written = 0
                for chunk in t.chunks():
                    chunk = memoryview(chunk).cast("B")  # flat bytes, whatever the producer's shape
                    for i in range(0, len(chunk), _CHUNK):
                        piece = chunk[i : i + _CHUNK]
                        f.write(piece)
                        digest.update(piece)
                    written += len(chunk)
                if written != t.nbytes:
                    raise RuntimeError(f"tensor {t.name} produced {written} bytes, expected {t.nbytes}")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskSpaceError(
                f"disk full while writing {path}: the merge needs about {space_needed / 1024**3:.2f} GiB "
                f"free in {path.parent.parent}; free space there or choose another output dir"
            ) from e
        raise
    return digest.hexdigest()
