"""Writing the trained adapter: atomically, with a canonical config and the base model's tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from slimtune.core import atomic


def _canonical_adapter_config(path: Path) -> None:
    """Rewrite peft's adapter_config.json with sorted module lists: peft writes `target_modules` from a set,
    in an order that changes with PYTHONHASHSEED, so equal adapters gave different bytes and the merge's
    input hash never matched on a re-run."""
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("target_modules", "modules_to_save"):
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    atomic.write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_adapter(model, tokenizer, final: Path, state_dict: dict | None = None) -> Path:
    """Write the adapter atomically; `state_dict`: the gathered full state dict of a sharded (FSDP) model."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    add_expert_lora(tmp, model)
    _canonical_adapter_config(tmp / "adapter_config.json")
    _save_base_tokenizer(tokenizer, tmp)
    atomic.replace_dir(atomic.follow_umask(tmp), final)
    return final


def add_expert_lora(folder: Path, model) -> None:
    """Add a mixture-of-experts model's expert LoRA to the adapter file peft wrote in `folder` (peft saves its
    own layers only); nothing for other models. Per expert, as peft would save LoRA on per-expert linears, so
    that peft's load (resume) hands them back to NF4Experts and the merge applies them like any other LoRA."""
    from safetensors.torch import load_file, save_file

    from slimtune.kernels.nf4_experts import expert_lora_checkpoint

    experts = expert_lora_checkpoint(model)
    if not experts:
        return
    path = folder / "adapter_model.safetensors"
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({**load_file(path), **experts}, tmp, metadata={"format": "pt"})
    tmp.replace(path)


def _save_base_tokenizer(tokenizer, out: Path) -> None:
    """The tokenizer's files as the base model has them, byte for byte (as the merge copies them).

    transformers 5.23's save_pretrained drops `legacy: true` from a Llama-2-style tokenizer_config.json, so
    the adapter's copy reloaded as legacy=False and tokenized text after a special token differently (seen:
    "<|im_start|>user" gave another id for "user"). Training never changes the tokenizer, so the files it
    was loaded from (`name_or_path`, the local model folder) are the right ones; save_pretrained still
    writes the names the folder lacks (e.g. chat_template.jinja where the base inlines it).
    """
    written = [Path(f) for f in tokenizer.save_pretrained(out)]
    base = Path(tokenizer.name_or_path)
    if not base.is_dir():  # not loaded from a folder (a tokenizer built in memory): what save_pretrained wrote
        return
    names = {f.name for f in written if f.parent == out} | set(tokenizer.vocab_files_names.values())
    for name in sorted(names):
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
