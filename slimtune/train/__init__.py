"""Training the LoRA adapter: Trainer on packed rows, atomic checkpoints, resume, progress callbacks.

The Trainer and its callbacks are imported from their modules (`slimtune.train.trainer`, `slimtune.train.callbacks`),
not from here: transformers' Trainer imports peft and bitsandbytes (~6 s on 2 cores), and the code that only plans
(plan/, the flow module, through `slimtune.train.step`) would pay for them with every import of this package.
"""

from slimtune.train.checkpoints import latest_checkpoint
from slimtune.train.options import ISOLATING_MODEL_TYPES, Batching, choose_batching
from slimtune.train.result import REPORT_FILE, TrainReport

__all__ = [
    "Batching",
    "ISOLATING_MODEL_TYPES",
    "REPORT_FILE",
    "TrainReport",
    "choose_batching",
    "latest_checkpoint",
]
