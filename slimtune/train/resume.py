"""Resume only from a complete checkpoint of the same data and settings: the fingerprint, and finding it.

A checkpoint records the fingerprint of what its training depends on (the spec's non-operational fields, the
data, the live model's LoRA and quantization settings and base weight files); a run resumes the latest
checkpoint with its own fingerprint, and moves others aside saying which settings changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from array import array
from pathlib import Path

import torch
from transformers import Trainer, TrainerState
from transformers.trainer import TRAINER_STATE_NAME

from slimtune.data import Examples
from slimtune.spec.schema import DataSpec, TrainSpec
from slimtune.train import checkpoints

log = logging.getLogger(__name__)

# TrainSpec fields that may change between a checkpoint and its resume without changing the result.
_OPERATIONAL = {
    "micro_batch_size",
    "effective_batch_size",
    "gradient_accumulation_steps",
    "resume",
    "empty_cache_steps",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "save_total_limit",
    "kernels",
    "cuda_graphs",
    "stored_layers",
    "num_gpus",
    "report_to",
}


def _canonical(value: object) -> object:
    """`value` with sets sorted and dicts' keys in order, so equal settings give equal JSON in every process.

    peft keeps `target_modules` as a set, whose iteration order depends on PYTHONHASHSEED.
    """
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float)) else str(value)


# peft config keys that do not change the trained weights (bookkeeping of the live model).
_PEFT_BOOKKEEPING = {"inference_mode", "runtime_config", "peft_version"}


def model_settings(model: torch.nn.Module) -> dict:
    """What the trained weights depend on that the model itself knows: its LoRA config and its quantization.

    Read from the live model rather than the spec, so that every adapter option (rank, alpha, dropout,
    targets, rslora, bias, trainable embeddings) and the base model's folder and 4-bit settings are covered
    however the model was built.
    """
    settings: dict = {}
    peft_config = getattr(model, "peft_config", {}).get("default")
    if peft_config is not None:
        lora = peft_config.to_dict()
        settings["lora"] = _canonical({k: v for k, v in lora.items() if k not in _PEFT_BOOKKEEPING})
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is not None:
        settings["quantization"] = _canonical(quant if isinstance(quant, dict) else quant.to_dict())
    base = getattr(getattr(model, "config", None), "_name_or_path", None)
    if base and (weights := _weights_key(Path(base))):
        settings["base_weights"] = weights
    return settings


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _weights_key(model_dir: Path) -> dict[str, list[int]]:
    """{file: [bytes, mtime in ns]} of every weight file of a local base model folder (empty for a Hub id).

    The folder's path alone let a re-run over weights overwritten in place (same config, another seed)
    report "nothing left to train" and merge the old adapter into the new base. Size and mtime are read
    in microseconds for any model size; a copy that does not keep mtimes (`cp` without -p) retrains once.
    """
    if not model_dir.is_dir():
        return {}
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name.endswith(".index.json"))
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def training_settings(
    train: TrainSpec, data: DataSpec, effective_batch: int, mode: str, model: torch.nn.Module
) -> dict:
    """Every setting a checkpoint's training depends on (the spec's operational fields left out)."""
    return _canonical(
        {
            "train": train.model_dump(exclude=_OPERATIONAL),
            "data": data.model_dump(),
            "effective_batch": effective_batch,
            "batching": mode,
            **model_settings(model),
        }
    )


def fingerprint_of(examples: Examples, settings: dict) -> str:
    """Identifies what a checkpoint's training depends on, so a changed spec or data never resumes it."""
    h = hashlib.sha256()
    h.update(json.dumps(settings, sort_keys=True).encode())
    for e in examples.train:
        h.update(array("q", e.input_ids).tobytes())
        h.update(array("q", e.labels).tobytes())
    return h.hexdigest()[:16]


def _changed(old: dict | None, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between `old` and `new` (empty when `old` is unknown)."""
    if old is None:
        return []
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return out


def find_resume(
    root: Path, fingerprint: str, resume: bool, settings: dict, off: str | None = None
) -> tuple[Path | None, float | None, str | None]:
    """The checkpoint to resume from, the eval loss measured before its training, and why not resumed."""
    checkpoints.remove_incomplete(root)
    latest = checkpoints.latest_checkpoint(root)
    if latest is None:
        return None, None, None
    state = checkpoints.read_state(latest)
    if resume and state.get("fingerprint") == fingerprint:
        log.info("resuming from %s (step %s)", latest, state.get("step"))
        return latest, state.get("eval_loss_before"), None
    if not resume:
        why = off or "train.resume is false"
    else:
        changed = _changed(state.get("settings"), settings)
        why = "changed since it was written: " + ("; ".join(changed) if changed else "the training data or settings")
    # Moved aside rather than refused: changing a setting and re-running under the same name is the
    # ordinary way to iterate, and the old checkpoints stay recoverable (one generation is kept).
    aside = root.with_name(f"{root.name}.previous")
    shutil.rmtree(aside, ignore_errors=True)
    root.rename(aside)
    message = f"not resuming from {latest} ({why}); training from scratch, old checkpoints moved to {aside}"
    log.warning(message)
    return None, None, message


def is_finished(checkpoint: Path) -> bool:
    """True when `checkpoint` was written at the last step of its training."""
    state = json.loads((checkpoint / TRAINER_STATE_NAME).read_text(encoding="utf-8"))
    return 0 < state.get("max_steps", 0) <= state.get("global_step", 0)


def load_experts(model, checkpoint: Path) -> None:
    """The checkpoint's expert LoRA into an MoE model's NF4Experts (nothing for other models): peft's load,
    in Trainer's resume and in `restore_finished`, does not reach them (`slimtune.kernels.nf4_experts`)."""
    from safetensors.torch import load_file

    from slimtune.kernels.nf4_experts import NF4Experts, load_expert_lora

    if any(isinstance(m, NF4Experts) for m in model.modules()):
        load_expert_lora(model, load_file(checkpoint / "adapter_model.safetensors"))


def restore_finished(trainer: Trainer, model, checkpoint: Path) -> None:
    """Load a finished checkpoint's adapter weights and trainer state instead of training.

    Trainer (transformers 5.23) resumed at the final step still trains one more step before it checks
    max_steps (measured: a re-run of a 4-step run reported 5 steps and published other weights), so a
    finished run is restored, not resumed.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
    load_experts(model, checkpoint)
    trainer.state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE_NAME))
    log.info("%s is the finished checkpoint of this run: restored, nothing left to train", checkpoint)


def nothing_left(resume_from: Path | None, previous: dict, run_dir: Path) -> bool:
    """Whether the checkpoint to resume from is the end of training and the earlier run's adapter is there."""
    if resume_from is None or not previous or not (run_dir / "adapter" / "adapter_config.json").is_file():
        return False
    try:
        state = json.loads((resume_from / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    step = state.get("global_step", -1)
    return step >= state.get("max_steps", 0) > 0 and previous.get("steps") == step
