"""Atomic checkpoints: written to a staging folder, marked complete, then renamed into place.

transformers' Trainer writes `checkpoint-N` in place, file by file, so a crash mid-save leaves a folder
that looks like a checkpoint but is not one. Here the Trainer writes into `.staging/`, our state file
and a `COMPLETE` marker go in last, and one `os.replace` publishes it; discovery only trusts folders
with the marker, and leftovers from a crash are deleted on the next start.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import shutil
import time
from pathlib import Path

import torch

from slimtune.core import atomic

log = logging.getLogger(__name__)

STAGING = ".staging"
COMPLETE = "COMPLETE"
STATE_FILE = "slimtune_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


# A full disk reaches us as OSError(ENOSPC/EDQUOT), as torch.save's RuntimeError("... file write failed" or,
# seen on a full tmpfs, "[enforce fail at inline_container.cc] unexpected pos N vs M": a short write), or
# as safetensors' SafetensorError("... StorageFull ...").
_DISK_FULL = re.compile(
    r"No space left|StorageFull|Disk quota|file write failed|unexpected pos \d+ vs \d+", re.IGNORECASE
)


def is_disk_full(error: BaseException) -> bool:
    """True when `error` says the disk (or quota) is full, whichever library raised it."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return bool(_DISK_FULL.search(str(error)))


def write_failure(root: Path, model: torch.nn.Module, error: BaseException) -> str:
    """Why a checkpoint could not be written, with the space it needs and what is free."""
    done = complete_checkpoints(root)
    if done:
        need = sum(f.stat().st_size for f in done[-1].rglob("*") if f.is_file())
    else:  # fp32 LoRA weights plus AdamW's two moments: 12 bytes per trainable parameter
        need = 12 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    free = shutil.disk_usage(root).free
    return (
        f"writing a checkpoint under {root} failed ({error}); a checkpoint needs about "
        f"{need / 2**20:.1f} MiB and {free / 2**20:.1f} MiB is free there. Free space, point output_dir at "
        f"a larger disk, or lower train.save_total_limit; no partial checkpoint was published"
    )


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT.match(p.name)) and (p / COMPLETE).is_file()
    ]
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
        if (
            p.name == STAGING
            or p.name.startswith(".checkpoint-")
            or (_CHECKPOINT.match(p.name) and not (p / COMPLETE).is_file())
        ):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if removed:
        log.warning("removed incomplete checkpoint leftovers from an earlier crash: %s", ", ".join(sorted(removed)))
    return removed


def read_state(checkpoint: Path) -> dict:
    """Our state file of a checkpoint (empty when absent)."""
    path = checkpoint / STATE_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def commit(staged: Path, root: Path, state: dict, keep: int) -> Path:
    """Finish a staged checkpoint (state + marker), rename it into `root` and keep the newest `keep`."""
    atomic.write_json(staged / STATE_FILE, state)
    atomic.write_json(staged / COMPLETE, {"step": state.get("step"), "time": time.time()})
    final = root / staged.name
    atomic.replace_dir(atomic.follow_umask(staged), final)
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
