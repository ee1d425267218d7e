"""load_4bit's input table and lm_head read straight into pinned host memory, where training keeps them.

Where the card cannot hold micro-batch 1 with the head on the GPU (`slimtune.plan.train_settings.head_on_host`),
training keeps both 16-bit tables in host memory (`host_embedding`, `host_lm_head`). Loaded onto the GPU first, they
would sit there beside every NF4 layer at load's peak (Llama-3.1-8B: 1.96 GiB of a 6 GiB card). Here the model is
built without them (`without_tables`), so `from_pretrained` reads neither, and `load_host_tables` reads each from
the checkpoint into pinned host memory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from slimtune.kernels import KernelPatch
from slimtune.merge.safetensors_io import as_tensor, checkpoint_shards, read_entries, read_raw

_Model = TypeVar("_Model", bound=nn.Module)
log = logging.getLogger(__name__)


def _tables(model: nn.Module) -> list[nn.Module]:
    return [model.get_input_embeddings(), model.get_output_embeddings()]


def without_tables(cls: type[_Model]) -> type[_Model]:
    """`cls` built without its input-embedding and lm_head weights, for one `from_pretrained` call (untied models).

    A subclass, not a patch of `cls`: it differs only in construction, and the instance it builds is a `cls` again as
    soon as it is built (`from_pretrained` then loads everything else into it as usual).
    """

    class WithoutTables(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            for module in _tables(self):
                module.weight = None  # out of the state dict: nothing to load or place
                module._is_hf_initialized = True  # else transformers' init of unloaded weights would fill it
            self.__class__ = cls  # transformers' own class from here on (a subclass would count as custom code)

    return WithoutTables


def _named_tables(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Each table with its checkpoint key."""
    names = {id(m): f"{name}.weight" for name, m in model.named_modules()}
    return [(module, names[id(module)]) for module in _tables(model)]


def table_names(model: nn.Module) -> set[str]:
    """The checkpoint keys of the two tables: what `from_pretrained` reports unexpected for a `without_tables` model."""
    return {name for _, name in _named_tables(model)}


def load_host_tables(model: nn.Module, model_dir: Path, dtype: torch.dtype, pin: bool) -> None:
    """Read the input table and the lm_head of `model` (built by `without_tables`) from the checkpoint into host
    memory (`pin`: page-locked, which the GPU reads over the bus), cast to `dtype` as `from_pretrained` casts.

    Raises:
        FileNotFoundError: a table is in no safetensors shard of `model_dir` (checked before either is read).
    """
    entries = {e.name: e for shard in checkpoint_shards(model_dir) for e in read_entries(shard)}
    wanted = _named_tables(model)
    missing = [name for _, name in wanted if name not in entries]
    if missing:
        raise FileNotFoundError(
            f"{model_dir}: {', '.join(missing)} is in none of its safetensors shards; model.name_or_path needs the "
            "whole checkpoint"
        )
    for module, name in wanted:
        entry = entries[name]
        table = torch.empty(entry.shape, dtype=dtype, pin_memory=pin)
        table.copy_(as_tensor(read_raw(entry), entry.dtype, entry.shape))
        module.weight = nn.Parameter(table, requires_grad=False)


def unread_tables_to_device(model: nn.Module, patch: KernelPatch, device: torch.device) -> None:
    """A table `load_host_tables` left in host memory whose kernel did not apply (`host_embedding`, `host_lm_head`;
    a patcher can refuse at run time) goes onto `device`, where the model's own forward reads it: nothing else would
    read it on the host. Warned, since the memory estimate counted it off the card."""
    for kernel, module in zip(("host_embedding", "host_lm_head"), _tables(model)):
        weight = getattr(module, "weight", None)
        if kernel in patch.applied or weight is None or weight.device == device or device.type == "cpu":
            continue
        log.warning(
            "%s was read into host memory for a card too small for it, but %s did not apply (%s): onto %s again",
            type(module).__name__,
            kernel,
            patch.skipped.get(kernel, "not selected"),
            device,
        )
        module.weight = nn.Parameter(weight.detach().to(device), requires_grad=False)
