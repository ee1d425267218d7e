#!/usr/bin/env python3
"""One TRL `SFTTrainer` run, as users of Unsloth or of HF + peft write it; a worker of benchmarks/user_compare.py.

  unsloth  `FastLanguageModel.from_pretrained(load_in_4bit=True)` + `get_peft_model` ("unsloth" checkpointing),
           then `SFTTrainer` with `packing=True`, as Unsloth's notebooks do (runner.py's loader).
  hf_trl   transformers `from_pretrained` with bitsandbytes NF4 (double quant), TRL attaching peft LoRA
           (`peft_config`), `packing=True, padding_free=True`, gradient checkpointing.

Both train the chat JSONL (TRL applies the tokenizer's chat template) in `ROOT/chat.jsonl` on the model saved in
`ROOT/model-KEY`, with the settings below, which `slimtune run` gets too. Measured in the process: the seconds
of `trainer.train()`, each step's seconds (a callback that synchronizes the device at every step end) and
real tokens (a wrapper around the trainer's collator; TRL's own `num_tokens` is kept as a cross-check), the
GPU allocator peaks while loading and while training. The result goes to `ROOT/TOOL.result.json`, also when
the run fails (status and the error's line).

Nothing here imports transformers, peft or trl at module level: Unsloth must be imported before them.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `benchmarks`, `slimtune`

from benchmarks.common import (
    LORA_RANK,
    LORA_TARGETS,
    MODEL_SHAPES,
    SEED,
    error_text,
    gib,
    package_version,
    write_json_atomic,
)

TOOLS = ("unsloth", "hf_trl")
NEEDS = {"unsloth": ("unsloth", "trl", "datasets"), "hf_trl": ("trl", "datasets")}
# The training settings of every tool in the comparison: slimtune's defaults, written out for TRL's config.
LEARNING_RATE = 2e-4
LR_SCHEDULE = "cosine"
OPTIMIZER = "adamw_torch"
MAX_GRAD_NORM = 1.0


def hf_attention(choice: str, device: str) -> str:
    """`auto`: flash_attention_2 where `flash_attn` imports on a GPU (what TRL recommends for padding-free
    rows), else SDPA (transformers isolates the packed rows by their position_ids)."""
    import importlib.util

    if choice != "auto":
        return choice
    return "flash_attention_2" if device.startswith("cuda") and importlib.util.find_spec("flash_attn") else "sdpa"


def batch_tokens(batch: dict[str, Any]) -> tuple[int, int]:
    """(real tokens, token slots) of a collated batch: padding-free rows are all real tokens; padded rows say
    which are real in their attention mask."""
    ids = batch["input_ids"]
    if batch.get("attention_mask") is not None:
        return int(batch["attention_mask"].sum()), ids.numel()
    return ids.numel(), ids.numel()


class CountingCollator:
    """The trainer's collator, recording each batch's tokens in the order the dataloader asks for them (with no
    accumulation step k trains batch k; a batch collated ahead of the last step is never counted)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[int] = []
        self.slots: list[int] = []

    def __call__(self, features):
        batch = self.inner(features)
        tokens, slots = batch_tokens(batch)
        self.tokens.append(tokens)
        self.slots.append(slots)
        return batch

    def __getattr__(self, name: str):  # the trainer may read the collator's settings (padding_free, ...)
        if name == "inner" or name.startswith("__"):  # copy.copy probes dunders before `inner` exists
            raise AttributeError(name)
        return getattr(self.inner, name)


def step_report(
    log_history: list[dict], step_seconds: list[float], tokens: list[int], slots: list[int], steps: int, train_s: float
) -> dict[str, Any]:
    """A train-report-like record (product.py's `report_stats` reads it, so the steady rate has one definition
    for every tool) from the Trainer's log, the per-step seconds and the per-batch token counts.

    When the collator saw fewer batches than steps (a trainer that replaced it), the per-step tokens come from
    TRL's cumulative `num_tokens` in the log instead.
    """
    logged = [e for e in log_history if "loss" in e and "step" in e]
    if len(tokens) < steps:
        cumulative = [int(e["num_tokens"]) for e in logged if "num_tokens" in e]
        tokens = [b - a for a, b in zip([0, *cumulative], cumulative, strict=False)]
        slots = tokens
    timed = len(step_seconds) >= steps and len(tokens) >= steps
    entries = [
        {
            "step": e["step"],
            "loss": e["loss"],
            "tokens_per_s": tokens[e["step"] - 1] / step_seconds[e["step"] - 1] if timed else None,
        }
        for e in logged
    ]
    used = sum(tokens[:steps])
    return {
        "losses": entries,
        "tokens": used,
        "padding_waste": 1 - used / max(sum(slots[:steps]), 1),
        "tokens_per_s": used / train_s,
        "resumed_from": None,  # a TRL run here always trains from the start
        "cuda_graphs": None,  # slimtune's graphs of the layers' backward: not in a TRL run
    }


def _step_clock(cuda: bool):
    """A TrainerCallback (imported here, after Unsloth) timing optimizer steps end to end: seconds between
    consecutive step ends, the first from its start, with the device synchronized at each."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.last: float | None = None

        @staticmethod
        def _now() -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, *_args, **_kwargs) -> None:
            if self.last is None:
                self.last = self._now()

        def on_step_end(self, *_args, **_kwargs) -> None:
            now = self._now()
            self.seconds.append(now - self.last)
            self.last = now

    return StepClock()


def _load(args: argparse.Namespace, model_dir: Path, result: dict[str, Any]):
    """(model, tokenizer, peft_config, tool-specific SFTConfig settings)."""
    if args.tool == "unsloth":
        from benchmarks.runner import import_unsloth, load_unsloth_lora

        model, tokenizer = load_unsloth_lora(import_unsloth(), model_dir, args.model, args.seq, args.lora_r)
        result["versions"] = {d: package_version(d) for d in ("unsloth", "unsloth_zoo", "trl")}
        return model, tokenizer, None, {}
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimtune.merge.nf4 import QuantSpec
    from slimtune.models.lora_targets import lora_target_modules

    attn = hf_attention(args.hf_attn, args.device)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        quantization_config=QuantSpec().bnb_config(torch.bfloat16),  # the NF4 settings `slimtune run` loads with
        dtype=torch.bfloat16,
        attn_implementation=attn,
        device_map={"": 0 if args.device.startswith("cuda") else "cpu"},
    )
    model.config.use_cache = False  # with a cache, packed rows attend across examples (shared/DESIGN.md)
    targets = lora_target_modules(MODEL_SHAPES[args.model].family, list(LORA_TARGETS))
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_r, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )
    result["attn_implementation"] = attn
    result["versions"] = {d: package_version(d) for d in ("trl", "peft", "bitsandbytes")}
    return model, AutoTokenizer.from_pretrained(model_dir), lora, {"padding_free": True, "gradient_checkpointing": True}


def train(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Load, build the SFTTrainer, train `args.steps` optimizer steps; fill `result`."""
    t0 = time.perf_counter()
    if args.tool == "unsloth":
        from benchmarks.runner import import_unsloth

        import_unsloth()  # first: before transformers, peft and trl
    import torch
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from slimtune.train.options import resolve_optimizer  # after Unsloth: it imports transformers

    cuda = args.device.startswith("cuda")
    root = Path(args.root)
    result["import_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    model, tokenizer, peft_config, extra = _load(args, root / f"model-{args.model}", result)
    result["load_s"] = round(time.perf_counter() - t0, 2)
    dataset = load_dataset("json", data_files=str(root / "chat.jsonl"), split="train", cache_dir=str(root / "hf-ds"))
    config = SFTConfig(
        output_dir=str(root / f"{args.tool}-out"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type=LR_SCHEDULE,
        warmup_steps=0,
        optim=resolve_optimizer(OPTIMIZER, torch.device(args.device)),  # as `slimtune run` resolves it
        weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
        bf16=cuda,
        seed=SEED,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        max_length=args.seq,
        packing=True,
        use_cpu=not cuda,
        **extra,
    )
    t0 = time.perf_counter()
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    result["trainer_init_s"] = round(time.perf_counter() - t0, 2)  # TRL tokenizes and packs the data here
    result["optimizer"] = config.optim
    result["collator"] = type(trainer.data_collator).__name__  # how this tool batches packed rows
    # what the tool adapted (an MoE's experts may or may not be among them)
    result["trainable_parameters"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    counter = trainer.data_collator = CountingCollator(trainer.data_collator)
    clock = _step_clock(cuda)
    trainer.add_callback(clock)
    if cuda:
        torch.cuda.synchronize()
        load_peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    steps = trainer.state.global_step
    history = trainer.state.log_history
    report = step_report(history, clock.seconds, counter.tokens, counter.slots, steps, train_s)
    report["batching"] = f"packed, {result['collator']}"  # the collator TRL (or Unsloth's patch) chose
    result.update(steps=steps, train_s=round(train_s, 2), tokens=report["tokens"])
    result["tokens_per_s"] = round(report["tokens_per_s"], 1)
    logged = [e["num_tokens"] for e in history if "num_tokens" in e]
    result["trl_num_tokens"] = int(logged[-1]) if logged else None  # TRL's own count: a cross-check of `tokens`
    result["report"] = report
    if cuda:
        peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        result.update(peak_allocated_gib=gib(peaks[0]), peak_reserved_gib=gib(peaks[1]))
        result["process_peak_allocated_gib"] = gib(max(load_peaks[0], peaks[0]))
        result["process_peak_reserved_gib"] = gib(max(load_peaks[1], peaks[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tool", choices=TOOLS, required=True)
    p.add_argument("--model", required=True, choices=list(MODEL_SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--root", required=True, help="holds model-KEY/ and chat.jsonl; gets TOOL.result.json")
    p.add_argument("--hf-attn", default="auto")
    p.add_argument("--lora-r", type=int, default=LORA_RANK, help="LoRA rank (alpha the same)")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"status": "ok", "error": None}
    try:
        train(args, result)
    except Exception as e:  # the row says what failed; the orchestrator goes on with the next tool
        traceback.print_exc()
        missing = isinstance(e, ModuleNotFoundError) and e.name in NEEDS[args.tool]
        oom = type(e).__name__ == "OutOfMemoryError"
        result.update(status="not installed" if missing else "oom" if oom else "error", error=error_text(e))
    write_json_atomic(Path(args.root) / f"{args.tool}.result.json", result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
