"""When a run publishes a new adapter, the merged model and GGUF files of the earlier adapter stop describing it.

A re-run that trained (a changed spec, or new steps) and then failed in the merge or the export left the
earlier run's `merged/` and `gguf/` beside the new adapter, with `spec.effective.yaml` describing the new run:
`slimtune generate`/`chat` then loaded a GGUF of another adapter. So as soon as training publishes its adapter,
the earlier merge is deleted (it is the size of the model, and `checkpoints.previous/` keeps the adapter it came
from) and the earlier GGUF files go to `gguf.previous/`, one generation kept, as for a changed export list.
Each step is a rename of a whole folder, so a kill leaves either the old or the new arrangement; a leftover
folder of a killed step is removed by the next run.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def set_aside_earlier_outputs(run_dir: Path) -> list[str]:
    """Delete `merged/` and move `gguf/` to `gguf.previous/` in `run_dir`; returns what was set aside."""
    done = []
    merged, doomed = run_dir / "merged", run_dir / ".merged.deleting"
    shutil.rmtree(doomed, ignore_errors=True)
    if merged.is_dir():
        os.replace(merged, doomed)  # gone from view at once; the delete of a large model may take a while
        shutil.rmtree(doomed, ignore_errors=True)
        done.append("merged/ (deleted)")
    gguf, previous, old = run_dir / "gguf", run_dir / "gguf.previous", run_dir / ".gguf.previous.old"
    shutil.rmtree(old, ignore_errors=True)
    if gguf.is_dir() and any(gguf.iterdir()):
        if previous.exists():
            os.replace(previous, old)
        os.replace(gguf, previous)
        shutil.rmtree(old, ignore_errors=True)
        done.append("gguf/ -> gguf.previous/")
    if done:
        log.warning("a new adapter was trained: the earlier run's %s", ", ".join(done))
    return done
