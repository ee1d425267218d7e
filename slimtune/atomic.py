"""Nothing half-written is ever published: write to a temporary name in the same folder, then rename."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (readers see the old file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, data: object) -> Path:
    """`write_text` for JSON (sorted keys, so equal data gives equal bytes)."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `final`, on failure it is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
