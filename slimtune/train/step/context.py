"""What wraps one `Trainer.train` call, in the order it is entered: the model's per-step walks from lists, each
checkpointed layer's trainable parameters from lists, the last layers' activations stored instead of recomputed,
and the layers' backward as CUDA graphs.

Each piece is a context manager that undoes itself (STYLE.md 4), and each works on explicit objects: the model
instance's own `train`/`parameters`/`zero_grad` (`walks`), the checkpointed layers' `_CheckpointedForward`
objects (`listed`, `stored`, `graphs`, from `checkpointing`). All assume one process that adds, removes or freezes
no module or parameter within the call: DDP and FSDP wrap modules inside `train()`, and DDP reduces gradients
from hooks on each parameter's accumulation, which a graph skips. Under them the step runs as the library's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from slimtune.train.step.checkpointing import graphed_backward, parameters_from_lists, stored_layers
from slimtune.train.step.layer_graphs import LayerGraphs
from slimtune.train.step.walks import walks_from_lists


@dataclass(frozen=True)
class StepSettings:
    """What the step's setup reads of a training attempt.

    Attributes:
        single_process: one process trains (`TrainingArguments.world_size == 1`): no DDP or FSDP wrapping.
        cuda_graphs: capture each checkpointed layer's backward (`TrainSettings.cuda_graphs`).
        stored_layers: how many of the last checkpointed layers keep their activations (`TrainSettings.stored_layers`).
    """

    single_process: bool
    cuda_graphs: bool
    stored_layers: int = 0


@dataclass(frozen=True)
class Step:
    """What `step_context` set up.

    Attributes:
        walks: whether `model.train()`, `.parameters()` and `.zero_grad()` answer from lists.
        listed: how many checkpointed layers take their trainable parameters from a list.
        stored: how many checkpointed layers keep their activations instead of being recomputed.
        graphs: the CUDA graphs of the layers' backward (their counts and why they went off), or None: eager.
    """

    walks: bool
    listed: int
    stored: int
    graphs: LayerGraphs | None


@contextlib.contextmanager
def step_context(model: nn.Module, settings: StepSettings) -> Iterator[Step]:
    """Within the block, `model` trains with the step's setup; everything is undone as the block ends.

    Use it around one `Trainer.train` call, within which no module or parameter is added, removed or frozen.
    """
    if not settings.single_process:
        yield Step(walks=False, listed=0, stored=0, graphs=None)
        return
    with (
        walks_from_lists(model) as walks,
        parameters_from_lists(model) as listed,
        stored_layers(model, settings.stored_layers) as stored,
    ):
        graphed = graphed_backward(model) if settings.cuda_graphs else contextlib.nullcontext()
        with graphed as graphs:
            yield Step(walks=walks, listed=listed, stored=stored, graphs=graphs)
