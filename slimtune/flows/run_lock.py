"""One run per run directory: an advisory `fcntl.flock` on a lock file keyed by the directory's path.

Two runs writing one run directory corrupt each other (the later one moves the live checkpoints away).
The kernel drops a flock when its holder dies, so a lock left by a killed run (SIGKILL, host OOM) is
taken over without any PID guessing; the PID in the file only names the holder in the message. The file
lives outside the run directory (in the temp folder, one per user and resolved run-dir path): a lock file
inside it was deleted with the directory mid-run, and a second run of the same name was then accepted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

_held: dict[Path, int] = {}  # run dir -> depth: the CLI and the flow it runs take the same lock in one process


class RunLocked(RuntimeError):
    """Another live process holds the run directory."""


def lock_path(run_dir: Path) -> Path:
    """The lock file of `run_dir`: named by a hash of its resolved path, so deleting the directory keeps it."""
    run_dir = Path(run_dir).resolve()
    key = hashlib.sha256(str(run_dir).encode()).hexdigest()[:32]
    return Path(tempfile.gettempdir()) / f"slimtune-locks-{os.getuid()}" / f"{key}.lock"


def _holder(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").partition("\n")[0].strip() or "unknown"
    except OSError:
        return "unknown"


def _acquire(path: Path, run_dir: Path) -> int:
    """Open and lock `path`; retried when the file was unlinked by its releasing holder in between."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLocked(
                f"run directory {run_dir} is in use by another slimtune run (PID {_holder(path)}); wait for "
                "it to finish or give this run another name or output_dir"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # we locked a file its holder had already unlinked: lock the new one


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run directory for the duration; raises `RunLocked` at once when another process holds it."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        _held[run_dir] += 1
        try:
            yield
        finally:
            _held[run_dir] -= 1
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(run_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = _acquire(path, run_dir)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n{run_dir}\n".encode())
    _held[run_dir] = 1
    try:
        yield
    finally:
        del _held[run_dir]
        path.unlink(missing_ok=True)  # while still locked: a waiter that opened it re-checks the inode
        os.close(fd)
