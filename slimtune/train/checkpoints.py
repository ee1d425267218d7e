"""Atomic checkpoints: written to a staging folder, marked complete, then renamed into place.

transformers' Trainer writes `checkpoint-N` in place, file by file, so a crash mid-save leaves a folder
that looks like a checkpoint but is not one. Here the Trainer writes into `.staging/`, our state file
and a `COMPLETE` marker go in last, and one `os.replace` publishes it; discovery only trusts folders
with the marker, and leftovers from a crash are deleted on the next start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STAGING = ".staging"
COMPLETE = "COMPLETE"
STATE_FILE = "slimtune_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to a temporary file next to `path`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; reports and state are meant to be readable
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(tmp: Path, final: Path) -> None:
    """Publish the finished folder `tmp` as `final`, replacing an older `final` without a gap in which
    neither is complete on disk for longer than two renames."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _CHECKPOINT.match(p.name)) and (p / COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def remove_incomplete(root: Path) -> list[str]:
    """Delete the staging folder and checkpoint folders without a COMPLETE marker (crash leftovers)."""
    if not root.is_dir():
        return []
    removed = []
    for p in root.iterdir():
        if p.name == STAGING or p.name.startswith(".checkpoint-") or (
                _CHECKPOINT.match(p.name) and not (p / COMPLETE).is_file()):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if removed:
        log.warning("removed incomplete checkpoint leftovers from an earlier crash: %s",
                    ", ".join(sorted(removed)))
    return removed


def read_state(checkpoint: Path) -> dict:
    """Our state file of a checkpoint (empty when absent)."""
    path = checkpoint / STATE_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def commit(staged: Path, root: Path, state: dict, keep: int) -> Path:
    """Finish a staged checkpoint (state + marker), rename it into `root` and keep the newest `keep`."""
    write_json_atomic(staged / STATE_FILE, state)
    write_json_atomic(staged / COMPLETE, {"step": state.get("step"), "time": time.time()})
    final = root / staged.name
    replace_dir(staged, final)
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
