"""Where a model's files are: builtin tiny models, local directories and Hub ids, all as a local folder.

Every stage reads the same folder (load_4bit the weights, dequant_merge the 16-bit shards, the GGUF
export the tokenizer), so it is resolved in one place, with the safety checks: safetensors only unless
the spec opts into pickle, and only architectures we support and test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from slimtune.core.bounded import loads_json
from slimtune.models.families import check_architecture
from slimtune.models.tiny import ensure_builtin, is_builtin

if TYPE_CHECKING:
    from slimtune.spec.schema import ModelSpec

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# config.json, the tokenizer (tokenizer.json/.model, vocab.json, merges.txt, its config) and chat templates
_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "tokenizer*"]


class ModelSourceError(ValueError):
    """The model cannot be used as given; the message names the spec field to change."""


def local_model_dir(model: ModelSpec) -> Path:
    """The local folder holding the model: builds builtin models, fetches Hub ids into the HF cache."""
    if is_builtin(model.name_or_path):
        return ensure_builtin(model.name_or_path)
    path = Path(model.name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = [*_TOKENIZER_PATTERNS, "*.safetensors"]
    if model.allow_pickle:
        patterns += ["*" + s for s in _PICKLE_SUFFIXES]
    return Path(snapshot_download(model.name_or_path, revision=model.revision, allow_patterns=patterns))


def tokenizer_files_dir(model: ModelSpec) -> Path | None:
    """The model folder with its config.json and tokenizer files at least: weights are not downloaded.

    For checks that need the tokenizer before the run (the GGUF tokenizer export): a Hub id fetches a few MB
    into the HF cache, the same snapshot folder `local_model_dir` later completes with the weights. None when
    the Hub cannot be reached and nothing is cached: load_4bit then reports the download's own error.
    """
    if is_builtin(model.name_or_path) or Path(model.name_or_path).expanduser().is_dir():
        return local_model_dir(model)
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(model.name_or_path, revision=model.revision, allow_patterns=_TOKENIZER_PATTERNS)
    except Exception:  # offline, gated or missing: as architecture_problem, left to load_4bit
        return None
    return Path(folder)


def architecture_problem(model: ModelSpec) -> str | None:
    """Before any work: why the model's architecture cannot run (one line), or None.

    Reads only config.json: from a local folder, or the Hub's config.json alone (a few KB); builtin models
    are families by construction. When the Hub cannot be reached the check is left to load_4bit.
    """
    if is_builtin(model.name_or_path):
        return None
    path = Path(model.name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return None  # load_4bit names the missing file
        return check_architecture(read_config(path))
    try:
        from huggingface_hub import hf_hub_download

        config_file = hf_hub_download(model.name_or_path, "config.json", revision=model.revision)
    except Exception:  # offline, gated or missing: load_4bit reports it with the download's own error
        return None
    return check_architecture(json.loads(Path(config_file).read_text(encoding="utf-8")))


def config_dtype(config: dict) -> str | None:
    """The dtype config.json says the weights are in ("bfloat16", "float16", "float32"; transformers 5 writes
    `dtype`, older checkpoints `torch_dtype`), or None: what `merge.output_dtype: auto` writes."""
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in ("bfloat16", "float16", "float32") else None


def read_config(model_dir: Path) -> dict:
    """config.json as a dict, with a clear error when it is missing."""
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise ModelSourceError(
            f"model.name_or_path: {model_dir} has no config.json; point it at a Hugging Face model folder"
        )
    return read_model_json(cfg)


def read_model_json(path: Path) -> dict:
    """One JSON file of the model folder (config.json, the tokenizer's), with an error that names the file."""
    try:
        return loads_json(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, NestingError, UnicodeDecodeError: name the file
        raise ModelSourceError(
            f"model.name_or_path: {path} is not valid JSON ({e}); download or copy the model again"
        ) from None


def check_model_dir(model: ModelSpec, model_dir: Path) -> dict:
    """Refuse unsupported architectures and pickle weights (unless allowed); returns the config dict."""
    cfg = read_config(model_dir)
    problem = check_architecture(cfg)
    if problem:
        raise ModelSourceError(problem)
    if cfg.get("slimtune_merged"):
        raise ModelSourceError(
            f"model.name_or_path: {model_dir} is a model slimtune already merged an "
            "adapter into; fine-tune its original base instead"
        )
    for shard in sorted(model_dir.glob("*.safetensors")):
        _check_shard(shard)
    has_safetensors = any(model_dir.glob("*.safetensors"))
    has_pickle = any(p.suffix in _PICKLE_SUFFIXES for p in model_dir.iterdir())
    if not has_safetensors:
        if not has_pickle:
            raise ModelSourceError(
                f"model.name_or_path: no weights (*.safetensors) in {model_dir}; download the whole model "
                "(`hf download ID --local-dir DIR`) or point at the folder that has them"
            )
        if not model.allow_pickle:
            raise ModelSourceError(
                f"model.allow_pickle: {model_dir} holds only pickle weights (.bin/.pt), which can run code "
                "when loaded; convert them to safetensors, or set model.allow_pickle: true to load them "
                "with weights_only=True"
            )
    return cfg


def _check_shard(shard: Path) -> None:
    """Refuse a truncated or damaged safetensors file before a library fails deep inside on it.

    The format is an 8-byte little-endian header length, a JSON header with each tensor's data offsets,
    then the data: a complete file is exactly 8 + header + the largest end offset bytes long.
    """
    size = shard.stat().st_size
    problem = None
    with shard.open("rb") as f:
        raw = f.read(8)
        header_len = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if header_len < 2 or 8 + header_len > size:
            problem = "its header is cut short"
        else:
            try:
                header = json.loads(f.read(header_len))
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError):
                problem = "its header is not valid safetensors JSON"
            else:
                if 8 + header_len + end != size:
                    problem = f"it holds {size} bytes but its header describes {8 + header_len + end}"
    if problem:
        raise ModelSourceError(
            f"model.name_or_path: {shard} is truncated or damaged ({problem}); download or copy the model again"
        )
