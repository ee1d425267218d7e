"""Checks of a valid spec against the machine and the files it names, before any model is loaded.

The spec's own validation (`slimtune.spec.schema`) sees one field at a time; these look outside it: can the run
directory and PREFECT_HOME be written, is the GPU there, are the model's files readable, do the LoRA
targets exist in the model (built on the meta device from config.json: no weights, no memory), do the
weight files match that model (`slimtune.checks.model_files`: their headers only), does the tokenizer fit the
embeddings and does the data leave examples to train on (`slimtune.checks.tokenizer_and_data`), is the push repo
id one the Hub accepts. Each problem is one line naming the field or file and the fix; `slimtune validate` and
`slimtune run` both print them and stop with exit code 2.

What a passing `validate` cannot promise: memory (out-of-memory is the memory guard's), the network (Hub
downloads and pushes), disk space, and data over 8 MB, whose counts the run checks when it starts, before the
model loads (`slimtune.checks.tokenizer_and_data`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from slimtune.core.bounded import clip
from slimtune.models.tiny import is_builtin
from slimtune.spec.schema import PipelineSpec

if TYPE_CHECKING:
    import torch


def spec_problems(spec: PipelineSpec) -> list[str]:
    """Every problem found, one line each (empty when the run can start)."""
    problems = _push_problems(spec) + _output_problems(spec) + prefect_home_problems() + _device_problems(spec)
    problems += _data_problems(spec)
    model_problems = _model_file_problems(spec)
    if not model_problems:  # a readable config.json: is the architecture supported, then its module names
        from slimtune.models.source import architecture_problem

        arch = architecture_problem(spec.model)
        model_problems = [arch] if arch else _built_model_problems(spec) + _gguf_tokenizer_problems(spec)
    return problems + model_problems


def _built_model_problems(spec: PipelineSpec) -> list[str]:
    """A local model folder against its config.json (the model built once, on the meta device), then the
    tokenizer and the data; a Hub model has no weights here to check."""
    from slimtune.checks.tokenizer_and_data import tokenizer_and_data_problems

    model_dir = _local_model_dir(spec)
    if model_dir is None:  # a Hub id: the tokenizer and the data still, without the weights
        return tokenizer_and_data_problems(spec)
    from slimtune.checks.model_files import weight_file_problems

    try:
        model = meta_model(model_dir)
    except Exception as e:  # from_pretrained builds the same model first, and would stop on the same error
        reason = clip(" ".join(str(e).split()), 300) or type(e).__name__
        return [f"model.name_or_path: {model_dir / 'config.json'} does not build a model ({reason}); fix or replace it"]
    problems = _target_problems(spec, model_dir, model) + weight_file_problems(spec.model, model_dir, model)
    problems += _stored_layers_problems(spec, model_dir)
    problems += _attention_sinks_problems(spec, model)
    return problems + _experts_problems(spec, model) + tokenizer_and_data_problems(spec)


def _attention_sinks_problems(spec: PipelineSpec, model: torch.nn.Module) -> list[str]:
    """An attention implementation that would run without gpt-oss's learned sinks (`Family.attention_sinks`)."""
    from slimtune.models.families import FAMILIES

    family = FAMILIES.get(getattr(model.config, "model_type", ""))
    chosen = spec.model.attn_implementation
    if family is None or not family.attention_sinks or chosen not in ("sdpa", "flash_attention_2"):
        return []
    why = "transformers has no SDPA path for it" if chosen == "sdpa" else "flash-attn 2 drops them without a word"
    return [
        f"model.attn_implementation: {chosen} cannot run {family.model_type}'s learned attention sinks ({why}); "
        "use auto (eager), eager or flex_attention"
    ]


def _stored_layers_problems(spec: PipelineSpec, model_dir: Path) -> list[str]:
    """A `train.stored_layers` count the model's decoder layers cannot meet."""
    from slimtune.memory.model_shape import model_shape
    from slimtune.models.multimodal import trained_config
    from slimtune.models.source import read_config

    stored = spec.train.stored_layers
    if stored == "auto":
        return []
    layers = model_shape(trained_config(read_config(model_dir))).layers
    if stored <= layers:
        return []
    return [
        f"train.stored_layers is {stored} but {model_dir / 'config.json'} has {layers} decoder layers; "
        f"use at most {layers} (or auto)"
    ]


def _experts_problems(spec: PipelineSpec, model: torch.nn.Module) -> list[str]:
    """What a mixture-of-experts model does not do yet: its experts are `NF4Experts`, which FSDP does not shard,
    whose per-expert LoRA the adapter GGUF has no layout for, and which load from safetensors shards only."""
    from slimtune.merge.safetensors_io import checkpoint_shards
    from slimtune.models.experts import EXPERT_CLASSES

    if not any(type(m).__name__ in EXPERT_CLASSES for m in model.modules()):
        return []
    problems = []
    if spec.train.sharded:
        problems.append(
            "train.parallelism: fsdp does not shard a mixture-of-experts model's NF4 experts yet; use "
            "train.parallelism: ddp (each GPU holds the whole model)"
        )
    if spec.export.adapter_gguf:
        problems.append(
            "export.adapter_gguf: the LoRA GGUF of a mixture-of-experts model's per-expert adapter is not written "
            "yet; set export.adapter_gguf: false (the merged GGUFs hold the adapter)"
        )
    model_dir = _local_model_dir(spec)
    if model_dir is not None and not checkpoint_shards(model_dir):  # pickle weights, which allow_pickle let through
        problems.append(
            f"model.name_or_path: {model_dir} holds its weights in pickle files, and load_4bit reads a "
            "mixture-of-experts model's experts from safetensors shards, one layer at a time; save the model "
            "as safetensors (transformers' save_pretrained does by default)"
        )
    return problems


def _push_problems(spec: PipelineSpec) -> list[str]:
    if spec.export.push is None:
        return []
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec.export.push.repo_id)
    except HFValidationError as e:
        return [f"export.push.repo_id: got {spec.export.push.repo_id!r}; {' '.join(str(e).split())}"]
    return []


def _output_problems(spec: PipelineSpec) -> list[str]:
    out = Path(spec.output_dir).expanduser()
    run_dir = spec.run_dir()
    for path, field in ((out, "output_dir"), (run_dir, "name")):
        if path.exists() and not path.is_dir():
            return [f"{field}: {path} exists and is a file, not a folder; remove it or choose another {field}"]
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"output_dir: {existing} is not writable by this user; choose a folder you can write to"]
    return []


def prefect_home_problems() -> list[str]:
    """PREFECT_HOME holds the temporary server's database, persisted task results and the GPU lock file.

    A run that could not write it retried for ~200 s and printed ~1,000 lines with 8 tracebacks, none
    naming PREFECT_HOME. Read through Prefect's settings: they also come from profiles and .env files.
    """
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    existing = next(p for p in (home, *home.parents) if p.exists())
    if not existing.is_dir():
        return [f"PREFECT_HOME: {home} is not a folder ({existing} is a file); set PREFECT_HOME to a folder"]
    if not os.access(existing, os.W_OK | os.X_OK):  # also false on a read-only mount, even for root
        where = "is" if existing == home else f"would be created in {existing}, which is"
        return [f"PREFECT_HOME: {home} {where} not writable; set PREFECT_HOME to a folder you can write to"]
    return []


def _device_problems(spec: PipelineSpec) -> list[str]:
    from slimtune.core.device import resolve_device

    try:
        resolve_device(spec.model.device)
    except RuntimeError as e:
        return [str(e)]
    return []


def _readable(path: Path, field: str) -> str | None:
    """A problem line when `path` cannot be read as UTF-8 text."""
    try:
        with path.open(encoding="utf-8") as f:
            while f.read(1 << 20):
                pass
    except PermissionError:
        return f"{field}: {path} is not readable by this user; fix its permissions (chmod o+r) or copy it"
    except UnicodeDecodeError as e:
        return f"{field}: {path} is not UTF-8 text (byte {e.start}); save it as UTF-8"
    except OSError as e:
        return f"{field}: cannot read {path} ({e.strerror}); check the file"
    return None


def _data_problems(spec: PipelineSpec) -> list[str]:
    path = Path(spec.data.path)
    if not path.is_file() or path.suffix.lower() == ".parquet":  # a Hub dataset id, or binary
        return [] if not path.is_file() or os.access(path, os.R_OK) else [f"data.path: {path} is not readable"]
    problem = _readable(path, "data.path")
    return [problem] if problem else []


def _local_model_dir(spec: PipelineSpec) -> Path | None:
    """The model folder when it is already on this machine (no download happens here)."""
    if is_builtin(spec.model.name_or_path):
        from slimtune.models.source import local_model_dir

        return local_model_dir(spec.model)
    path = Path(spec.model.name_or_path).expanduser()
    return path if path.is_dir() else None


def _model_file_problems(spec: PipelineSpec) -> list[str]:
    from slimtune.models.source import ModelSourceError, read_model_json

    model_dir = _local_model_dir(spec)
    if model_dir is None:
        return []
    problems = []
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        path = model_dir / name
        if not path.exists() and name != "config.json":
            continue
        if not path.exists():
            problems.append(f"model.name_or_path: {path} is missing; point it at a Hugging Face model folder")
            continue
        problem = _readable(path, "model.name_or_path")
        if problem is None:
            try:
                read_model_json(path)  # the parser (and message) load_4bit meets: model_source's
            except ModelSourceError as e:
                problem = str(e)
        if problem:
            problems.append(problem)
    return problems


def meta_model(model_dir: Path) -> torch.nn.Module:
    """The model of `model_dir`'s config.json, built on the meta device: shapes, no weights, no memory; for a
    multimodal checkpoint its language model, the model load_4bit loads and LoRA targets."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir).get_text_config())


def model_modules(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(every module name, the last name part of every Linear except the output head) of `model`."""
    import torch

    modules = list(model.named_modules())
    linear = {n.rsplit(".", 1)[-1] for n, m in modules if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    return [n for n, _ in modules if n], sorted(linear)


def _gguf_tokenizer_problems(spec: PipelineSpec) -> list[str]:
    """Whether each requested GGUF can carry the tokenizer with identical ids, from the tokenizer files alone:
    before training, not after it (`slimtune.export.gguf_tokenizer_check`). A Hub model's tokenizer files are
    downloaded for it, without the weights."""
    if not spec.export.gguf:
        return []
    from slimtune.models.source import tokenizer_files_dir

    model_dir = tokenizer_files_dir(spec.model)
    if model_dir is None:
        return []
    from slimtune.export.gguf_tokenizer_check import tokenizer_export_problem

    problem = tokenizer_export_problem(model_dir, as_is=spec.export.gguf_tokenizer == "as_is")
    return [problem] if problem else []


def _target_problems(spec: PipelineSpec, model_dir: Path, model: torch.nn.Module) -> list[str]:
    targets = spec.lora.target_modules
    if targets == "all-linear":
        return []
    import json

    from slimtune.models.lora_targets import lora_target_modules

    model_type = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("model_type", "")
    try:  # what attach_lora asks peft for: q/k/v become qkv_proj where the family fuses them (Phi-3)
        targets = lora_target_modules(model_type, targets)
    except ValueError as e:
        return [str(e)]
    names, linear = model_modules(model)
    # peft matches a target against a module name exactly or as its dotted suffix
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return []
    return [f"lora.target_modules: {missing} not in this model; choose from {linear} or use all-linear"]
