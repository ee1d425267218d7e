"""`slimtune init`: a commented starting spec from a model and a data file, without loading any weights.

What it reads: the model's config.json (family, context length, shape for the memory estimate) and
tokenizer (chat template, token lengths of the data); the data's first records (format). What it
proposes: max_seq_length from the data's token lengths, and the largest divisor of effective_batch_size
whose estimate fits the GPU memory: what `micro_batch_size: auto` would choose and `slimtune plan` reports
for the proposal as auto (slimtune.plan.fit.plan itself, so init and plan cannot disagree). Every field it sets
carries a comment saying where the value came from, so the user can judge it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

from slimtune.data import DataError, FieldError, detect_format, iter_records, render
from slimtune.models.experts import expert_count
from slimtune.models.families import FAMILIES, check_architecture
from slimtune.models.multimodal import layout_of, trained_config
from slimtune.models.source import read_config
from slimtune.models.tiny import ensure_builtin, is_builtin
from slimtune.plan.fit import Budget, detected_gpu_total, plan
from slimtune.spec.schema import DEFAULT_TARGETS, DataSpec, ModelSpec, PipelineSpec, SpecError, TrainSpec, parse_spec

_GIB = 1024**3
# Records tokenized to measure lengths: enough for a stable 99th percentile, bounded for big files.
_SAMPLE_RECORDS = 2000
# max_seq_length covers this share of examples; the longest 1% are truncated rather than making
# every packed row (and the activation memory) longer for a handful of outliers.
_LENGTH_QUANTILE = 0.99
_LENGTH_STEP = 64  # rows in multiples of 64 tokens: tensor-core friendly, and readable
# Rows per optimizer step (micro-batch x accumulation): the spec's effective_batch_size default, 16, what
# the QLoRA paper used for most runs; the micro-batch is a divisor of it, as with `micro_batch_size: auto`.
_TARGET_BATCH = TrainSpec.model_fields["effective_batch_size"].default
_LORA_R = 16  # rank 16 on all projections: the QLoRA paper's setting
# Small data: at least this many optimizer steps where fewer rows per step and up to _MAX_EPOCHS passes give
# them (80 chat records used to get 4 steps, too few for the loss to move or for its curve to say anything).
_MIN_STEPS = 50
_MAX_EPOCHS = 3
_CPU_MICRO_BATCH = 4  # without a GPU budget there is nothing to size against


class ScaffoldError(ValueError):
    """`init` cannot propose a spec; the message names the option and what to give instead."""


def _model_dir(name: str) -> Path:
    """The local folder of config.json and tokenizer; a Hub id fetches those files only, no weights."""
    try:
        ModelSpec(name_or_path=name)
    except ValueError as e:
        raise ScaffoldError(f"--model {name}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    if is_builtin(name):
        return ensure_builtin(name)
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.model", "*.jinja", "tokenizer*", "*.txt"]))
    except Exception as e:  # offline, private, misspelled: one line naming the model
        raise ScaffoldError(f"--model {name}: cannot fetch its config and tokenizer ({type(e).__name__}: {e})") from e


def _token_lengths(data_path: str, tokenizer) -> tuple[str, list[int], int]:
    """(format, token lengths of the sampled records, records read); skips malformed records."""
    data = DataSpec(path=data_path)
    fmt, lengths, seen = None, [], 0
    for raw in iter_records(data_path):
        if seen >= _SAMPLE_RECORDS:
            break
        seen += 1
        if raw.problem is not None:
            continue
        try:
            fmt = fmt or detect_format(raw.value, data)
            lengths.append(len(render(raw.value, fmt, data, tokenizer)[0]))
        except FieldError as e:
            if fmt is None or "chat template" in str(e):
                raise ScaffoldError(f"--data {data_path}: {raw.where}: {e}") from None
    if not lengths:
        raise ScaffoldError(f"--data {data_path}: no usable record among the first {seen}; check the file")
    return fmt, lengths, seen


def _propose_seq_len(lengths: list[int], context: int) -> int:
    ordered = sorted(lengths)
    at_quantile = ordered[min(len(ordered) - 1, math.ceil(_LENGTH_QUANTILE * len(ordered)) - 1)]
    return max(_LENGTH_STEP, min(context, math.ceil(at_quantile / _LENGTH_STEP) * _LENGTH_STEP))


def _propose_micro_batch(spec: PipelineSpec, cfg: dict, gpu_total: int | None) -> tuple[int, str]:
    """`slimtune plan`'s largest micro-batch for `spec` (micro_batch_size auto), and the comment saying so."""
    if gpu_total is None:
        return _CPU_MICRO_BATCH, (
            "no --gpu-memory given and no GPU found: the default; re-run init with --gpu-memory to size it"
        )
    budget = Budget(gpu_total, spec.guard.gpu_memory_fraction, None)
    rows, limits = plan(spec, cfg, budget)
    est = next(r.estimate for r in rows if r.stage == "packed_sft")
    mb, seq, card = limits["micro_batch"], spec.data.max_seq_length, f"{gpu_total / _GIB:.1f} GiB"
    if limits["largest_micro_batch"] is None:
        return mb, f"even {mb} x {seq} is estimated at {est.gpu_bytes / _GIB:.2f} GiB, over {card}"
    why = limits["extras"].auto_note.partition("; ")[2]  # `auto_micro_batch`'s reason; init sets its own accumulation
    tight = "" if budget.gpu_fits(est) else ", a tight fit: its tensors fit"
    return mb, f"{why}, as in `slimtune plan`: {est.gpu_bytes / _GIB:.2f} GiB on {card}{tight}"


def _spec_path(path: Path) -> str:
    """The data path as the spec holds it: relative to the working directory when the file is under it (the
    spec is printed to be saved there, and a relative path is read against the spec's folder, then the working
    directory), so the spec moves with its project; else absolute."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)


def _propose_length(
    lengths: list[int], records: int, seq_len: int, eval_fraction: float, micro_batch: int
) -> tuple[int, int, str, str]:
    """(accumulation, epochs, accumulation comment, epochs comment). Packed rows of `seq_len` tokens per epoch
    come from the sampled lengths scaled to the records read; small data gets fewer rows per optimizer step
    (down to one micro-batch), then more passes, until it has _MIN_STEPS steps or _MAX_EPOCHS passes."""
    tokens = sum(min(n, seq_len) for n in lengths) * records / len(lengths)
    rows = max(1, math.ceil(tokens * (1 - eval_fraction) / seq_len))
    accumulation = max(1, _TARGET_BATCH // micro_batch)
    while accumulation > 1 and math.ceil(rows / (micro_batch * accumulation)) < _MIN_STEPS:
        accumulation //= 2
    per_epoch = math.ceil(rows / (micro_batch * accumulation))
    epochs = min(_MAX_EPOCHS, math.ceil(_MIN_STEPS / per_epoch))
    batch = micro_batch * accumulation
    accumulation_note = f"{batch} packed rows per optimizer step"
    if batch < micro_batch * max(1, _TARGET_BATCH // micro_batch):
        accumulation_note += f" (fewer than {_TARGET_BATCH} for small data: ~{rows} rows a pass)"
    epochs_note = f"~{per_epoch * epochs} optimizer steps: {per_epoch} a pass over ~{rows} packed rows"
    if epochs > 1:
        epochs_note += f"; {epochs} passes for small data (watch the eval loss for overfitting)"
    return accumulation, epochs, accumulation_note, epochs_note


def scaffold_spec(model: str, data: str, *, gpu_memory: int | None = None, name: str | None = None) -> str:
    """A commented YAML spec for `model` on `data` (validated before it is returned).

    Args:
        gpu_memory: the card's memory in bytes (`slimtune.cli.sizes.parse_size`); default: this GPU's, if any.

    Raises:
        ScaffoldError: the model or the data cannot be used; the message says which.
    """
    from transformers import AutoTokenizer

    data_path = Path(data).expanduser()
    if not data_path.is_file():
        raise ScaffoldError(f"--data {data}: file not found; give a local .jsonl/.json/.parquet file")
    gpu_total = detected_gpu_total(gpu_memory)
    device = "cpu" if gpu_total is None else "auto"
    model_dir = _model_dir(model)
    try:
        cfg = read_config(model_dir)
    except ValueError as e:
        raise ScaffoldError(f"--model {model}: {e}") from None
    if problem := check_architecture(cfg):
        raise ScaffoldError(f"--model {model}: {problem}")
    family = cfg["model_type"]
    if layout_of(cfg):
        cfg = trained_config(cfg)
        family += f", its language model {cfg['model_type']} trained, the vision tower left as it is"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    has_template = bool(tokenizer.chat_template)
    try:
        fmt, lengths, seen = _token_lengths(str(data_path.resolve()), tokenizer)
    except DataError as e:
        raise ScaffoldError(f"--data {data}: {e}") from None
    context = int(cfg.get("max_position_embeddings") or 4096)
    seq_len = _propose_seq_len(lengths, context)
    covered = sum(n <= seq_len for n in lengths)
    checkpointing = False if device == "cpu" else "unsloth"
    run_name = name or re.sub(r"[^A-Za-z0-9._-]+", "-", f"{Path(model).name}-{data_path.stem}").strip("-.")[:64]
    try:  # the proposal as `micro_batch_size: auto` sees it, to size it as the planner does
        sizing = parse_spec(
            {
                "name": run_name,
                "model": {"name_or_path": model, "device": device},
                "lora": {"r": _LORA_R, "target_modules": DEFAULT_TARGETS, "gradient_checkpointing": checkpointing},
                "data": {"path": str(data_path.resolve()), "max_seq_length": seq_len},
                "train": {"micro_batch_size": "auto", "effective_batch_size": _TARGET_BATCH},
            },
            source="the proposed spec",
        )
    except SpecError as e:  # a bug here, not the user's
        raise ScaffoldError(f"the proposed spec does not validate ({e}); please report it") from None
    micro_batch, mb_note = _propose_micro_batch(sizing, cfg, gpu_total)
    eval_fraction = 0.1 if len(lengths) >= 20 else 0.0
    accumulation, epochs, accumulation_note, epochs_note = _propose_length(
        lengths, seen, seq_len, eval_fraction, micro_batch
    )

    def line(key: str, value: Any, comment: str, indent: int = 2) -> str:
        text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
        return f"{' ' * indent}{key}: {text}  # {comment}"

    out = [
        f"# slimtune spec proposed by `slimtune init` for {model} on {data_path.name}.",
        "# Check it with `slimtune validate`, then `slimtune run`. Every field not written here keeps its default.",
        line("name", run_name, "names the run directory", 0),
        line("output_dir", "runs", "relative to this file's folder", 0),
        "model:",
        line("name_or_path", model, f"family {family} (config.json model_type), context {context} tokens"),
    ]
    if device == "cpu":
        out.append(line("device", "cpu", "no GPU found and no --gpu-memory given"))
    out += [
        "lora:",
        line("r", _LORA_R, f"rank {_LORA_R} on all projections: the QLoRA paper's setting"),
        line("alpha", _LORA_R, "update scaled by alpha / r = 1"),
        line("target_modules", DEFAULT_TARGETS, _targets_note(cfg)),
        line(
            "gradient_checkpointing",
            checkpointing,
            "recompute with layer inputs offloaded to host: least GPU memory"
            if checkpointing
            else "off on the CPU: it only saves GPU memory and costs time",
        ),
        "data:",
        line("path", _spec_path(data_path), f"{seen} records read to make this proposal"),
        line(
            "format",
            fmt,
            f"detected from the first record; the tokenizer {'has a' if has_template else 'has no'} chat template",
        ),
        line(
            "max_seq_length",
            seq_len,
            f"covers {covered} of {len(lengths)} examples (longest {max(lengths)} tokens, median "
            f"{sorted(lengths)[len(lengths) // 2]}); longer ones are truncated",
        ),
        line("eval_fraction", eval_fraction, "held out for eval loss and perplexity"),
        "train:",
        line("micro_batch_size", micro_batch, mb_note),
        line("gradient_accumulation_steps", accumulation, accumulation_note),
        line("learning_rate", 2e-4, f"the usual QLoRA learning rate for r={_LORA_R}"),
        line("epochs", epochs, epochs_note),
        "export:",
        line("gguf", ["q8_0"], "add q4_k_m for a smaller file (needs llama-cpp-python)"),
        "",
    ]
    text = "\n".join(out)
    try:
        parse_spec(yaml.safe_load(text), source="the proposed spec")
    except SpecError as e:  # a bug here, not the user's: say so rather than print a spec that fails
        raise ScaffoldError(f"the proposed spec does not validate ({e}); please report it") from None
    return text


def _targets_note(cfg: dict) -> str:
    """What the default targets train in this family: a hybrid model's linear-attention layers get their own, a
    mixture of experts' MLP names are every expert's."""
    row = FAMILIES.get(cfg["model_type"])
    if row is not None and row.experts:
        return (
            f"attention, and gate/up/down of each of the {expert_count(cfg)} experts in every layer "
            "(held in NF4 by slimtune; the router stays frozen)"
        )
    if row is None or not row.linear_attention_targets:
        return "attention and MLP projections of every layer"
    deltanet = ", ".join(row.linear_attention_targets)
    return f"attention and MLP projections, and {deltanet} on linear-attention layers (conv1d, A_log, dt_bias frozen)"
