"""Training the LoRA adapter: Trainer on packed rows, atomic checkpoints, resume, progress callbacks."""

from slimtune.train.callbacks import LogCallback, PrefectProgressCallback
from slimtune.train.checkpoints import latest_checkpoint
from slimtune.train.options import ISOLATING_MODEL_TYPES, Batching, choose_batching
from slimtune.train.result import REPORT_FILE, TrainReport
from slimtune.train.trainer import train_adapter

__all__ = [
    "Batching",
    "ISOLATING_MODEL_TYPES",
    "LogCallback",
    "PrefectProgressCallback",
    "REPORT_FILE",
    "TrainReport",
    "choose_batching",
    "latest_checkpoint",
    "train_adapter",
]
