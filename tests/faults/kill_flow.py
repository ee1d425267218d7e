"""The real finetune flow, deployed by test_kill.py, with kill points that a fault plan arms.

A Prefect process worker imports this file in a fresh process per flow run. When the environment names a
plan folder (SLIMTUNE_FAULT_PLAN), three points inside the pipeline check it: a training step, a merged
shard half written, a GGUF half written. They are armed when the flow run starts (an on_running hook): the
worker's crash-hook process loads this file too, and importing the training code there cost it ~6 s per crash.
The plan holds files `<n>-<point>.kill`; the lowest-numbered one fires at its point: the process records what
is on disk, deletes that plan file and SIGKILLs itself, as the host's OOM killer would (no exception, no
cleanup, no state report). Without the variable this module is just the finetune flow.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from faultlib import check_published, leftovers, tree

from slimtune.flows.finetune import finetune as _finetune

__all__ = ["finetune"]
_PLAN = os.environ.get("SLIMTUNE_FAULT_PLAN")
KILL_AT_STEP = 3  # one step after the checkpoint at step 2: the kill costs at most one interval


def _maybe_kill(point: str, **facts: object) -> None:
    plan = Path(_PLAN)
    pending = sorted(plan.glob("*.kill"))
    if not pending or pending[0].stem.split("-", 1)[1] != point:
        return
    run_dir = Path((plan / "run_dir.txt").read_text().strip())
    report = run_dir / "train_report.json"
    snapshot = {
        "point": point,
        **facts,
        "tree": tree(run_dir),
        "leftovers": leftovers(run_dir),
        "published_problems": check_published(run_dir),
        "train_report": json.loads(report.read_text()) if report.is_file() else None,
    }
    (plan / f"{pending[0].stem}.snapshot.json").write_text(json.dumps(snapshot, indent=1))
    pending[0].unlink()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(_flow: object, _flow_run: object, _state: object) -> None:
    """Install the kill points in this flow-run process (a flow's on_running hook)."""
    import slimtune.export.gguf_write as gguf_write
    import slimtune.merge.stream as merge_stream
    from slimtune.train.trainer import _SlimTrainer

    step = _SlimTrainer.training_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.state.global_step == KILL_AT_STEP:
            _maybe_kill("train_step", global_step=self.state.global_step)
        return step(self, model, inputs, num_items_in_batch)

    write_shard = merge_stream.write_shard

    def write_shard_then_die(path, tensors, space_needed):
        first = tensors[0]

        def chunks():
            for chunk in first.chunks():
                yield chunk
                _maybe_kill("merge_write", file=str(path))  # after the first tensor's bytes went out

        tensors = [type(first)(first.name, first.dtype, first.shape, first.nbytes, chunks), *tensors[1:]]
        return write_shard(path, tensors, space_needed)

    encode = gguf_write._encode
    calls = {"n": 0}

    def encode_then_die(data, qtype):
        calls["n"] += 1
        if calls["n"] == 10:  # nine tensors are in the temporary file
            _maybe_kill("gguf_write", tensors_written=9)
        return encode(data, qtype)

    _SlimTrainer.training_step = training_step
    merge_stream.write_shard = write_shard_then_die
    gguf_write._encode = encode_then_die


finetune = _finetune.with_options(on_running=[_arm]) if _PLAN else _finetune
