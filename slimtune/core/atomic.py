"""Nothing half-written is ever published: write to a temporary name in the same folder, then rename."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it (os.umask can only be read by setting it, which races
    with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def mkstemp(prefix: str, suffix: str, dir: Path) -> tuple[int, str]:
    """`tempfile.mkstemp` whose file gets the mode an ordinary new file gets (0666 less the umask), not 0600:
    it is published by a rename, and a GGUF an Ollama service account cannot read is useless."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=dir)
    os.fchmod(fd, 0o666 & ~umask())
    return fd, name


def mkdtemp(prefix: str, dir: Path, suffix: str | None = None) -> Path:
    """`tempfile.mkdtemp` whose folder gets the mode of an ordinary new folder (0777 less the umask), not 0700:
    temporary folders are published by a rename (merged/)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=dir))
    path.chmod(0o777 & ~umask())
    return path


def follow_umask(folder: Path) -> Path:
    """Give every file and folder under `folder` the mode a new one gets from the umask, before it is published.

    What libraries write is not always so: the adapter's and checkpoints' adapter_model.safetensors came out
    0600 (measured, umask 022), unreadable to an Ollama service account or a teammate.
    """
    mask = umask()
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    return folder


def write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (readers see the old file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
