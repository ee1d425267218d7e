"""Do a local model folder's weight files fit its config.json? Read from the safetensors headers alone.

`run` found these only in `from_pretrained`, after the model started loading (exit 1, no field named): a
config.json that disagrees with the weights, an index naming a shard that is not there, a shard missing a
tensor its index promises, a folder with no weights at all. Each header is a few KB at the start of its
file, so the whole check reads kilobytes whatever the model's size, and the model it compares with is built
on the meta device (no memory). Pre-quantized bitsandbytes checkpoints are compared through their recorded
4-bit shapes; tensors the files hold that the model does not use (rotary `inv_freq`) are left alone, as
`from_pretrained` leaves them, and a tied output head may be absent.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from slimtune.merge.prequantized import is_prequantized, split_stored_4bit
from slimtune.merge.safetensors_io import TensorEntry, read_entries
from slimtune.models.experts import expert_key, fused_shapes
from slimtune.models.multimodal import layout_of, text_key
from slimtune.models.source import ModelSourceError, check_model_dir, read_model_json
from slimtune.spec.schema import ModelSpec

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_AGAIN = "download or copy the model again"
# config.json fields that size a tensor dimension directly, named in the hint for a mismatched dimension
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def weight_file_problems(model: ModelSpec, model_dir: Path, meta_model: torch.nn.Module) -> list[str]:
    """One line per problem of the weight files against `meta_model` (built from the folder's config.json)."""
    try:  # what the run plan checks first: weights present, safetensors whole, pickle only when allowed
        config = check_model_dir(model, model_dir)
    except ModelSourceError as e:
        return [str(e)]
    if model.allow_pickle and not any((model_dir / n).is_file() for n in (_SINGLE, _INDEX)):
        return []  # pickle weights, allowed (from_pretrained falls back to them): no header to read
    method = (config.get("quantization_config") or {}).get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":  # GPTQ/AWQ/FP8 store other tensors (qweight, scales): load_4bit names them
        return []
    entries, problems = _stored_entries(model_dir)
    if problems:
        return problems
    if is_prequantized(config):  # packed uint8 halves: compare the shapes recorded in their quant_state
        entries, _ = split_stored_4bit(entries)
    if layout_of(config):  # a multimodal checkpoint: `meta_model` is its language model, read from these keys
        entries = [replace(e, name=name) for e in entries if (name := text_key(e.name)) is not None]
    return _shape_problems(model_dir, _with_fused_experts(entries), meta_model, config)


def _with_fused_experts(entries: list[TensorEntry]) -> list[TensorEntry]:
    """`entries` plus the fused expert parameters their per-expert tensors make (`slimtune.models.experts`),
    which is how the model built from config.json names them."""
    first = {}
    for e in entries:
        if (key := expert_key(e.name)) is not None:
            first.setdefault(key.block, e)
    fused = fused_shapes((e.name, e.shape) for e in entries)
    return entries + [replace(first[name.rpartition(".")[0]], name=name, shape=shape) for name, shape in fused.items()]


def _stored_entries(model_dir: Path) -> tuple[list[TensorEntry], list[str]]:
    """The tensors `from_pretrained` reads: model.safetensors, else the index's shards (it looks at no other)."""
    index = model_dir / _INDEX
    if (model_dir / _SINGLE).is_file():
        return read_entries(model_dir / _SINGLE), []
    if not index.is_file():
        names = ", ".join(sorted(p.name for p in model_dir.glob("*.safetensors"))[:3])
        return [], [
            f"model.name_or_path: {model_dir} has {names} but neither {_SINGLE} nor {_INDEX}, the files "
            f"transformers loads; rename a single file to {_SINGLE}, or {_AGAIN}"
        ]
    try:
        weight_map = read_model_json(index).get("weight_map")
    except ModelSourceError as e:
        return [], [str(e)]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return [], [f"model.name_or_path: {index} has no weight_map of tensor -> file; {_AGAIN}"]
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (model_dir / s).is_file()]
    if missing:
        return [], [
            f"model.name_or_path: {index} names {len(missing)} shard(s) that are not in {model_dir} "
            f"(first: {missing[0]}); {_AGAIN}"
        ]
    entries = [e for s in shards for e in read_entries(model_dir / s)]
    held = {(e.file.name, e.name) for e in entries}
    absent = [(n, s) for n, s in weight_map.items() if (Path(s).name, n) not in held]
    if absent:
        name, shard = absent[0]
        return [], [
            f"model.name_or_path: {index} puts {len(absent)} tensor(s) in shards that do not hold them "
            f"(first: {name} in {shard}); {_AGAIN}"
        ]
    return entries, []


def _shape_problems(
    model_dir: Path, entries: list[TensorEntry], meta_model: torch.nn.Module, config: dict
) -> list[str]:
    prefix = getattr(meta_model, "base_model_prefix", "") + "."

    def key(name: str) -> str:  # a base-model checkpoint stores `layers.0...` for the model's `model.layers.0...`
        return name.removeprefix(prefix)

    stored = {key(e.name): e for e in entries}
    expected = {key(n): tuple(t.shape) for n, t in meta_model.state_dict(keep_vars=True).items()}
    for name, shape in expected.items():
        entry = stored.get(name)
        if entry is not None and entry.shape != shape:
            return [
                f"model.name_or_path: {model_dir / 'config.json'} does not match the weights: {entry.name} is "
                f"{list(entry.shape)} in {entry.file.name} but {list(shape)} from config.json"
                f"{_size_hint(shape, entry.shape, config)}; use the config.json that came with these weights"
            ]
    # a parameter is needed unless some name it is tied to (lm_head to embed_tokens) is stored
    groups: dict[int, list[str]] = {}
    for name, p in meta_model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    missing = [names[0] for names in groups.values() if not any(key(n) in stored for n in names)]
    if not missing:
        return []
    layers = {int(m.group(1)) for n in stored if (m := _LAYER.search(n))}
    hint = ""
    if layers and any((m := _LAYER.search(n)) and int(m.group(1)) > max(layers) for n in missing):
        hint = f" (num_hidden_layers? the weights hold {max(layers) + 1} layers)"
    return [
        f"model.name_or_path: the weights in {model_dir} lack {len(missing)} tensor(s) the model of its "
        f"config.json needs (first: {missing[0]}){hint}; use the config.json that came with these weights, "
        f"or {_AGAIN}"
    ]


def _size_hint(want: tuple[int, ...], have: tuple[int, ...], config: dict) -> str:
    """' (config.json hidden_size: 64, the weights say 32?)' for the first differing dimension that a size
    field of config.json (or of its text_config) sets directly, else ''."""
    sizes = {**config, **(config.get("text_config") or {})}
    for w, h in zip(want, have, strict=False):
        if w != h:
            field = next((f for f in _SIZE_FIELDS if sizes.get(f) == w), None)
            return f" (config.json {field}: {w}, the weights say {h}?)" if field else ""
    return f" (the weights have {len(have)} dimensions, the model {len(want)})"
