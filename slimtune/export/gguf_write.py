"""A GGUF's tensors written and published: declared in the header, the disk checked for them, each loaded, encoded
and written one at a time into a temporary folder, then moved into place (the text GGUF and the mmproj alike)."""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def write_tensors(
    writer: gguf.GGUFWriter,
    tensors: list[tuple[str, tuple[int, ...], Q, Callable[[], np.ndarray]]],
    out_path: Path,
    tmp_dir: Path,
) -> list[Path]:
    """Write `writer`'s file(s) under `tmp_dir` with each (name, shape, type, load) tensor, loaded and encoded one
    at a time, then move them beside `out_path`; returns the published paths. The disk is checked for the tensor
    data first (the header, vocabulary included, adds well under 1% more).

    Raises:
        OSError: ENOSPC before writing, or any write error, naming the file, the bytes needed and the bytes free.
    """
    need = 0
    for name, shape, qtype, _ in tensors:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = math.prod(shape) // block * block_bytes
        need += n_bytes
        writer.add_tensor_info(name, shape, np.dtype(np.float32), n_bytes, raw_dtype=qtype)
    free = shutil.disk_usage(out_path.parent).free
    if need > free:
        raise OSError(
            errno.ENOSPC,
            f"not enough disk space for {out_path}: the tensors need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB is "
            "free there; free space or point output_dir at a larger disk",
        )
    tmp_files = writer.format_shard_names(tmp_dir / out_path.name)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, _, qtype, load in tensors:
            writer.write_tensor_data(_encode(load(), qtype))
        writer.close()
    except OSError as e:  # e.g. the disk filled up while writing: say where and how much was needed
        free = shutil.disk_usage(out_path.parent).free
        raise OSError(
            e.errno,
            f"writing {out_path} failed ({e}); it needs {need / 1e9:.2f} GB and "
            f"{free / 1e9:.2f} GB is free there; nothing was published",
        ) from e
    final = [out_path.parent / f.name for f in tmp_files]
    for tmp, dst in zip(tmp_files, final):
        os.replace(tmp, dst)
    return final


def _encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return data.astype(np.float32, copy=False)
    if qtype == Q.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)  # BF16 rounding and Q8_0/Q4_0/Q5_0 match ggml's bytes
