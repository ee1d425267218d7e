"""Nothing half-written is ever published: write to a temporary name in the same folder, then rename."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (readers see the old file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; reports and state are meant to be readable
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


def replace_dir(tmp: Path, final: Path) -> None:
    """Publish the finished folder `tmp` as `final`, replacing an older `final`.

    The old folder is first renamed aside, so at every moment `final` is either the complete old or
    the complete new folder (two renames apart), and it is deleted only once the new one is in place.
    """
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent)) / "previous"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)


def sweep_leftovers(folder: Path, name: str) -> list[Path]:
    """Remove what a killed writer of `name` left in `folder`: its `.{name}.*` temporaries and old copies.

    Call it before writing `name` again. Two writers of the same output at once are already a conflict;
    this assumes there is at most one.
    """
    removed = sorted(folder.glob(f".{name}.*")) if folder.is_dir() else []
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed
