"""Move aside the GGUF files of an earlier run that this run's export list no longer produces.

A re-run with another `export.gguf` list left the earlier files in `gguf/` beside the new ones, so the folder
(and a push of it) described two runs. They go to `gguf.previous/`, one generation kept as with
`checkpoints.previous/`: moved by rename into a staging folder, which then replaces `gguf.previous/`, so no
file is ever half-copied, and a run killed in between finishes the move on its re-run.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


def set_aside_previous_ggufs(out_dir: Path, keep: Iterable[str]) -> list[str]:
    """Move every finished `*.gguf` in `out_dir` not named in `keep` to `<out_dir>.previous/`; returns their names."""
    keep = set(keep)
    stale = sorted(p for p in out_dir.glob("*.gguf") if not p.name.startswith(".") and p.name not in keep)
    if not stale:
        return []
    previous = out_dir.with_name(f"{out_dir.name}.previous")
    staging = out_dir.with_name(f".{out_dir.name}.previous.tmp")  # kept by a killed move: filled on, not emptied
    staging.mkdir(exist_ok=True)
    for p in stale:
        os.replace(p, staging / p.name)
    shutil.rmtree(previous, ignore_errors=True)
    staging.rename(previous)
    names = [p.name for p in stale]
    log.warning("moved GGUF files this run's export.gguf does not produce to %s: %s", previous, ", ".join(names))
    return names
