"""The product's training path on a benchmark shape: slimtune's `attach_lora` and `packed_sft` task functions.

What runs is what `slimtune run` runs after loading: LoRA attached by `slimtune.tasks.attach_lora` (peft,
"unsloth" checkpointing, `train.kernels: auto`), then `slimtune.tasks.packed_sft` (transformers' Trainer,
packing, the collator, the log and progress callbacks, checkpoint bookkeeping, adapter and report written)
on a chat JSONL written here. Only the loader differs: the random weights are quantized in place, as for
the other configs, instead of a 16 GB safetensors round trip through `load_4bit`.

The speed is the train report's: each optimizer step is logged (`logging_steps: 1`), each log entry
carries the tokens/s of its step (real tokens, padding excluded), and the row's figure is the median
over the steps after `warmup`. Peak allocated covers the whole `packed_sft` call.
`product` runs with the spec's default `train.cuda_graphs: true`; `product_eager` is the same with `false`.
`product_sdpa` is a diagnostic: `product_eager` with packed rows left on SDPA with a dense block mask.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.common import (
    LORA_RANK,
    MODEL_SHAPES,
    GpuPeak,
    ProcessRssSampler,
    build_random_model,
    error_text,
    free_memory,
    make_row,
    memory_fields,
    quantize_nf4_,
    synchronize,
)

if TYPE_CHECKING:  # the benchmark imports slimtune's task modules only inside its workers
    from transformers import TrainerCallback

    from slimtune.plan.run_plan import RunPlan
    from slimtune.tasks.attach_lora import LoraResult
    from slimtune.train import TrainReport

PRODUCT_CONFIGS = ("product", "product_sdpa", "product_eager")


def write_chat_data(path: Path, tokens_needed: int, seed: int = 0) -> Path:
    """Chat records of skewed lengths (most short, a tail near the row length), enough for the run."""
    from slimtune.models.tiny import _corpus

    rng = random.Random(seed)
    words = " ".join(_corpus()).split()
    written = 0
    with path.open("w", encoding="utf-8") as f:
        while written < tokens_needed:
            n = int(40 * (1500 / 40) ** rng.random())  # words; log-uniform 40..1500
            answer = " ".join(rng.choice(words) for _ in range(n))
            record = {
                "messages": [{"role": "user", "content": "Write some text."}, {"role": "assistant", "content": answer}]
            }
            f.write(json.dumps(record) + "\n")
            written += n
    return path


def _spec(root: Path, batch: int, seq: int, steps: int, name: str, device: str, cuda_graphs: bool = True):
    from slimtune.spec.schema import parse_spec

    return parse_spec(
        {
            "name": name,
            "output_dir": str(root / "runs"),
            "model": {"name_or_path": str(root / "model"), "device": device},
            "lora": {"r": LORA_RANK, "alpha": LORA_RANK, "dropout": 0.0, "gradient_checkpointing": "unsloth"},
            "data": {
                "path": str(root / "chat.jsonl"),
                "format": "messages",
                "max_seq_length": seq,
                "eval_fraction": 0.0,
            },
            "train": {
                "micro_batch_size": batch,
                "gradient_accumulation_steps": 1,
                "max_steps": steps,
                "save_steps": 100000,
                "logging_steps": 1,
                "kernels": "auto",
                "cuda_graphs": cuda_graphs,
            },
            "merge": {"enabled": False},
            "export": {"gguf": []},
        }
    )


@dataclass
class ProductSetup:
    """A random NF4 model with LoRA attached as the product attaches it, and the chat data prepared."""

    root: Path
    handle: str
    lora: LoraResult  # kernels applied, and the checkpointing handle
    examples: str
    plan: RunPlan  # the plan the flow would resolve
    setup: dict[str, Any]


def prepare_product(
    model_key: str, max_batch: int, seq: int, total_steps: int, device: str, scratch: Path
) -> ProductSetup:
    """Build the random NF4 model, attach LoRA as `attach_lora` does and prepare the chat data for `packed_sft`."""
    from slimtune.core import registry
    from slimtune.core.device import resolve_compute_dtype
    from slimtune.models.tiny import build_tokenizer
    from slimtune.plan.run_plan import RunPlan
    from slimtune.tasks.attach_lora import attach_lora
    from slimtune.tasks.packed_sft import prepare_data

    root = Path(scratch) / f"product-{model_key}"
    # A run folder left by an earlier worker would make packed_sft resume that finished run: nothing trained,
    # the old report timed again (seen on a warm device machine). Every setup starts empty.
    shutil.rmtree(root, ignore_errors=True)
    (root / "model").mkdir(parents=True)
    t0 = time.perf_counter()
    model = build_random_model(MODEL_SHAPES[model_key], device)
    model.config.save_pretrained(root / "model")  # the spec names a model folder: config and tokenizer only
    build_tokenizer().save_pretrained(root / "model")
    quantize_nf4_(model)
    synchronize(device)
    setup = {"kind": "setup", "model": model_key, "build_s": round(time.perf_counter() - t0, 2)}
    write_chat_data(root / "chat.jsonl", tokens_needed=int(1.3 * max_batch * seq * total_steps))
    # The plan the flow would resolve; built here because the folder holds no weights (the model is in memory).
    plan = RunPlan(
        model_dir=str(root / "model"),
        config=model.config.to_dict(),
        family=model.config.model_type,
        device=str(device),
        compute_dtype=str(resolve_compute_dtype("auto", torch.device(device))).removeprefix("torch."),
    )
    handle = registry.put("model", model)
    del model
    lora = attach_lora(_spec(root, 1, seq, total_steps, "setup", device), handle, plan=plan)
    setup.update(kernels=lora.kernels, kernels_skipped=lora.kernels_skipped)
    examples = prepare_data(_spec(root, 1, seq, total_steps, "data", device), str(root / "model"))
    return ProductSetup(root, handle, lora, examples, plan, setup)


def train_product(
    ps: ProductSetup,
    name: str,
    batch: int,
    seq: int,
    total_steps: int,
    device: str,
    callbacks: list[TrainerCallback] | None = None,
    cuda_graphs: bool = True,
) -> TrainReport:
    """`packed_sft` at micro-batch `batch` (accumulation 1, "unsloth" checkpointing); returns its TrainReport."""
    from slimtune.tasks.packed_sft import packed_sft

    return packed_sft(
        _spec(ps.root, batch, seq, total_steps, name, device, cuda_graphs),
        ps.handle,
        ps.lora.checkpointing_handle,
        ps.examples,
        micro_batch_size=batch,
        gradient_accumulation_steps=1,
        gradient_checkpointing="unsloth",
        plan=ps.plan,
        callbacks=callbacks,
    )


def product_worker(
    model_key: str, config: str, batches: list[int], seq: int, warmup: int, steps: int, device: str, scratch: Path, emit
) -> None:
    """Build the random NF4 model, attach LoRA as the product does, and time `packed_sft` per micro-batch."""
    if config == "product_sdpa":
        import slimtune.train.trainer as trainer_module

        trainer_module.prefer_varlen = lambda model, device: False  # this worker process only: the A/B
    total_steps = warmup + steps
    ps = prepare_product(model_key, max(batches), seq, total_steps, device, scratch)
    emit(ps.setup | {"configs": [config]})
    for b in batches:
        row = make_row(model_key, config, b, seq, "ok", warmup=warmup, notes={"kernels": ps.lora.kernels})
        rss, mem = ProcessRssSampler(), GpuPeak(device)
        try:
            free_memory(device)
            with rss, mem:
                name = f"{config}-{model_key}-b{b}"
                report = train_product(ps, name, b, seq, total_steps, device, cuda_graphs=config == "product")
            row.update(report_stats(report, warmup))
        except torch.OutOfMemoryError as e:
            row.update(status="oom", error=error_text(e))
        except Exception as e:
            traceback.print_exc()
            row.update(status="error", error=error_text(e))
        row.update(memory_fields(mem, rss))
        emit(row)


def report_stats(report, warmup: int) -> dict[str, Any]:
    """tokens/s of the steps after warm-up, from the train report's per-step log entries."""
    if report.resumed_from:
        raise RuntimeError(f"packed_sft resumed {report.resumed_from} instead of training: not a measurement")
    timed = [e for e in report.losses if e["step"] > warmup and e.get("tokens_per_s")]
    if not timed:
        raise RuntimeError(f"the train report has no step after warm-up {warmup}: {report.losses}")
    speeds = [e["tokens_per_s"] for e in timed]
    med = statistics.median(speeds)
    return {
        "tokens_per_s": round(med, 1),
        "tokens_per_s_min": round(min(speeds), 1),
        "tokens_per_s_max": round(max(speeds), 1),
        "steps_timed": len(timed),
        "padding_waste": round(report.padding_waste, 4),
        "batching": report.batching,
        "loss_first": round(report.losses[0]["loss"], 4),
        "loss_last": round(report.losses[-1]["loss"], 4),
        "report_tokens_per_s": round(report.tokens_per_s, 1),  # the whole run, warm-up and setup included
        "cuda_graphs": report.cuda_graphs,
    }
