"""Evaluation of a run: loss and perplexity on a data file, and base vs fine-tuned answers to fixed prompts.

Loss is the mean cross-entropy over target tokens (the tokens training learns: assistant turns or
completions, as the run's data settings say), and perplexity is its exponential, so the figures of
`slimtune eval` are comparable with the eval loss in the train report.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

from slimtune.data import IGNORE_INDEX, Example, load_examples
from slimtune.spec.schema import DataSpec, ModelSpec


def perplexity(loss: float | None) -> float | None:
    """exp(loss), None for None (no eval set), inf where it overflows."""
    if loss is None:
        return None
    return math.exp(loss) if loss < 700 else math.inf


def held_out_metrics(train_report: dict) -> dict[str, float | None]:
    """Eval loss and perplexity on the held-out split, before and after training (from the train report)."""
    keys = ("eval_loss_before", "perplexity_before", "eval_loss_after", "perplexity_after")
    return {k: train_report.get(k) for k in keys}


def loss_on(model, examples: list[Example]) -> dict[str, float | int]:
    """Target-token-weighted mean loss and perplexity of `model` over `examples`, one example per forward."""
    import torch

    device = next(model.parameters()).device
    total, targets = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.input_ids], device=device)
            labels = torch.tensor([ex.labels], device=device)
            logits = model(ids, use_cache=False).logits[0, :-1].float()
            shifted = labels[0, 1:]
            total += float(
                torch.nn.functional.cross_entropy(logits, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
            )
            targets += int((shifted != IGNORE_INDEX).sum())
    loss = total / max(1, targets)
    return {"loss": loss, "perplexity": perplexity(loss), "target_tokens": targets, "examples": len(examples)}


def _release() -> None:
    """Return the memory of a model the caller has just dropped (one model at a time is the peak)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def base_model_dir(run_spec: dict[str, Any]) -> Path:
    """The base model folder of a run (builtin models are rebuilt, Hub ids come from the HF cache)."""
    from slimtune.models.source import local_model_dir

    return local_model_dir(ModelSpec(**run_spec["model"]))


def evaluate_file(run_dir: str | Path, data_file: str, *, include_base: bool = False) -> dict[str, Any]:
    """Loss and perplexity of the run's merged model (and optionally its base) on every record of `data_file`.

    The file is read with the run's data settings (format, fields, completion-only loss, max_seq_length).

    Raises:
        RunDirError: the run has no merged model or spec.
        DataError: the file is missing or has a bad record.
    """
    from transformers import AutoTokenizer

    from slimtune.core.device import resolve_device
    from slimtune.inference.generate import load_hf_model, merged_dir, read_run_spec

    run_dir = Path(run_dir).expanduser()
    spec = read_run_spec(run_dir)
    merged = merged_dir(run_dir)
    data = DataSpec(
        **{**spec["data"], "path": str(Path(data_file).expanduser()), "eval_fraction": 0.0, "sources": None}
    )
    tokenizer = AutoTokenizer.from_pretrained(merged)
    examples = load_examples(data, tokenizer).train
    device = str(resolve_device(spec["model"].get("device", "auto")))
    result: dict[str, Any] = {"data": data.path, "run_dir": str(run_dir)}
    models = {"fine_tuned": merged} | ({"base": base_model_dir(spec)} if include_base else {})
    for label, folder in models.items():
        model = load_hf_model(folder, device)
        result[label] = loss_on(model, examples)
        del model
        _release()
    return result


def compare_generations(
    base_dir: Path, merged: Path, prompts: list[str], *, max_new_tokens: int, device: str
) -> list[dict[str, str]]:
    """Greedy answers of the base and the fine-tuned model to each prompt (a user turn when chat-templated).

    One model is loaded at a time, so the peak is one model's memory.
    """
    from transformers import AutoTokenizer

    from slimtune.inference.generate import Generator, HFBackend, load_hf_model, model_context

    tokenizer = AutoTokenizer.from_pretrained(merged)
    rows = [{"prompt": p} for p in prompts]
    for label, folder in (("base", base_dir), ("fine_tuned", merged)):
        model = load_hf_model(folder, device)
        gen = Generator(tokenizer, HFBackend(model), model_context(folder))
        for row in rows:
            row[label] = gen.answer(row["prompt"], max_new_tokens)
        del gen, model
        _release()
    return rows
