"""Trainer's per-step walks of the whole model, answered from lists made once per `Trainer.train` call.

Every optimizer step Trainer calls `model.train()` (a recursion through every module, each flag set through
`Module.__setattr__`: 1,337 modules in a 1B QLoRA model), `model.parameters()` for gradient clipping and
`model.zero_grad()`. cProfile of the product's 1B step on an H100 put the three at 32 ms of a 210 ms step;
without the profiler (`benchmarks/product_gap.py`) they took 9.43 ms of host time per 1B step, and 0.28 ms from
the lists. Within one single-process `train()` call no module or parameter is added or removed, so lists made
on entry give the same answers: for the call the model instance gets its own `train`, `parameters` and
`zero_grad`, which use them, and then loses them again. Nothing of torch, peft or transformers is patched,
and the model's class is untouched.

`train(mode)` still runs the class's own `train` whenever a module's flag differs from `mode` (evaluation
switches to eval and back); it skips only the walk that would change nothing, which is exact for
`nn.Module.train` and for transformers' override (it acts only on a change of mode). A module class with
any other `train` override turns the shortcut off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

_ATTRIBUTES = ("train", "parameters", "zero_grad")


def _plain_train_methods() -> set:
    from transformers import PreTrainedModel

    return {nn.Module.train, PreTrainedModel.train}


@contextlib.contextmanager
def walks_from_lists(model: nn.Module) -> Iterator[bool]:
    """Within the block, `model.train()`, `.parameters()` and `.zero_grad()` use lists made on entry.

    Yields whether the shortcut is on: off when the model already has its own (instance) versions of these
    or a module overrides `train` in some other way. Use it around one `Trainer.train` call on one process:
    DDP and FSDP wrap or replace modules inside that call.
    """
    modules = list(model.modules())
    plain = _plain_train_methods()
    if any(name in model.__dict__ for name in _ATTRIBUTES) or any(type(m).train not in plain for m in modules):
        yield False
        return
    params = list(model.parameters())
    cls = type(model)

    def train(mode: bool = True) -> nn.Module:
        if any(m.training != mode for m in modules):
            cls.train(model, mode)
        return model

    def parameters(recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(params) if recurse else cls.parameters(model, recurse)

    def zero_grad(set_to_none: bool = True) -> None:
        if not set_to_none:
            cls.zero_grad(model, set_to_none)
            return
        for p in params:
            if p.grad is not None:
                p.grad = None

    model.__dict__.update(zip(_ATTRIBUTES, (train, parameters, zero_grad), strict=True))
    try:
        yield True
    finally:
        for name in _ATTRIBUTES:
            model.__dict__.pop(name, None)
