"""The train report: what training did, written to run_dir/train_report.json and read back by a re-run."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field
from datetime import UTC
from pathlib import Path

REPORT_FILE = "train_report.json"


@dataclass
class TrainReport:
    """What training did; also written to run_dir/train_report.json."""

    steps: int
    losses: list[dict]
    eval_loss_before: float | None
    eval_loss_after: float | None
    tokens_seen: int
    tokens_per_s: float
    padding_waste: float
    packing_efficiency: float
    batching: str
    batching_fallback: str | None
    resumed_from: str | None
    not_resumed: str | None  # why existing checkpoints were not resumed (they were moved aside)
    seconds: float  # this call, data preparation and evals included
    training_seconds: float  # training time of the whole run: a resumed run adds to its checkpoint's
    micro_batch_size: int
    gradient_accumulation_steps: int
    optimizer: str
    precision: str
    adapter_dir: str
    data: dict = field(default_factory=dict)
    perplexity_before: float | None = None  # exp(eval loss): the held-out figure people compare across runs
    perplexity_after: float | None = None
    run_id: str | None = None  # the Prefect flow run that trained (None outside Prefect)
    finished_at: str | None = None  # UTC, ISO 8601
    reused_from: str | None = None  # run_id (or finished_at) of the run whose results a 0-step re-run reuses
    # This process's share of each logged loss: under DDP the logged loss is the mean of the ranks' shares
    # (each rank's summed token losses x world size / the whole step's target tokens); one process: = losses.
    rank_losses: list[float] = field(default_factory=list)
    # CUDA graphs of the layers' backward: "N captured, M replays", with why they went off if they did; None
    # where they were not used (train.cuda_graphs false, more than one process, or `graphs_refusal`'s reasons)
    cuda_graphs: str | None = None
    # Checkpointed decoder layers (the last ones) that kept their activations instead of being recomputed
    stored_layers: int = 0


def read_report(run_dir: Path) -> dict:
    """The train report an earlier run left in `run_dir` (fields this version does not know are dropped)."""
    try:
        raw = json.loads((run_dir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    fields = TrainReport.__dataclass_fields__
    required = {k for k, f in fields.items() if f.default is MISSING and f.default_factory is MISSING}
    return {k: v for k, v in raw.items() if k in fields} if required <= set(raw) else {}


def run_identity() -> tuple[str | None, str]:
    """(the Prefect flow run id, or None outside Prefect; the UTC time now)."""
    from datetime import datetime

    from prefect.runtime import flow_run

    return flow_run.id, datetime.now(UTC).isoformat(timespec="seconds")
