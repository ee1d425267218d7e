#!/usr/bin/env python3
"""Side-by-side QLoRA training speed and memory on real model shapes with random weights, in one command.

Configs (each on the same NF4 + double-quant model, LoRA r=16 on the seven projections, bf16 autocast,
fused AdamW, one fixed random batch):
  hf_gc    HF transformers + peft + bitsandbytes, standard non-reentrant gradient checkpointing
  hf_nogc  the same without checkpointing
  liger    hf_gc + liger-kernel (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy)
  unsloth  Unsloth's FastLanguageModel on the same random weights saved to local disk, "unsloth" checkpointing
  product  slimtune as users run it: the attach_lora and packed_sft task functions (Trainer, packing, collator,
           callbacks) on a chat JSONL; tokens/s from the train report's steps after warm-up (benchmarks/product.py)
  ours     a diagnostic hand loop: enable_checkpointing(model, "unsloth") + apply_kernels(model, "auto")
  product_sdpa  a diagnostic: product with packed rows on SDPA's dense block mask instead of varlen flash
  product_eager  product with train.cuda_graphs: false (product runs with the default, true)
A config whose package does not import is recorded as "not installed"; nothing is ever estimated.

Isolation: one worker process per (model, process group). hf_gc and hf_nogc share a process and a model
(only the checkpointing switch differs); ours, liger and unsloth get their own, because liger replaces
module-level functions of transformers and Unsloth must be imported before transformers. Each worker
writes its rows as JSON lines as soon as they are measured, so a worker killed at the time budget keeps
what it finished; workers run group by group (HF and ours on every model first, Unsloth last).
`--in-process` runs the non-Unsloth groups in this process instead (CPU smoke tests).

Usage:
  python3 benchmarks/runner.py --models 1b,8b,qwen7b --configs hf_gc,hf_nogc,liger,unsloth,ours \
      --batch 1,4 --seq 2048 --warmup 2 --steps 5 --out "$OUT" [--rounds 2] [--merge] [--gguf] [--budget-s 560]
Writes OUT/bench.json (env, rows, ratios against hf_gc, merge/GGUF export, worker overheads) and
OUT/bench.md (the tables).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `benchmarks`, `slimtune`

import torch

from benchmarks.common import (
    CONFIGS,
    ERROR_CHARS,
    LORA_RANK,
    LORA_TARGETS,
    MODEL_SHAPES,
    attach_lora,
    build_random_model,
    command_line,
    environment,
    error_text,
    free_memory,
    gib,
    make_row,
    measure_training,
    package_version,
    quantize_nf4_,
    save_word_tokenizer,
    synchronize,
    trainable_parameters,
    trim_host_heap,
    write_json_atomic,
    write_text_atomic,
)
from benchmarks.product import PRODUCT_CONFIGS, product_worker
from benchmarks.report import combine_rounds, compute_ratios, render_markdown
from slimtune.models.families import FAMILIES
from slimtune.models.lora_targets import lora_target_modules

# Headline comparison first (baseline, product, hand loop, Unsloth), diagnostics last, so a run cut short by the
# budget still holds it.
_GROUPS = (
    ("hf_gc", "hf_nogc"),
    ("product",),
    ("ours",),
    ("unsloth",),
    ("product_eager",),
    ("product_sdpa",),
    ("liger",),
)
# Packages whose absence makes a config "not installed" (checked with find_spec, without importing).
_NEEDS = {"liger": "liger_kernel", "unsloth": "unsloth"}
_WORKER_MIN_S = 20  # do not start a worker with less budget left than this: it could not finish a row
_ROW_MARK = "[row]"


# ------------------------------------------------------------------------------------------ the loss hook
def ours_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """slimtune's training loss for one batch.

    With slimtune's `fused_linear_ce` kernel applied (part of `apply_kernels(model, "auto")` on CUDA),
    calling the model with `labels=` returns the loss computed chunk by chunk from the last hidden state,
    with no full logits tensor; without it this is the plain transformers loss.
    """
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _plain_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


# ---------------------------------------------------------------------------------- config preparation
class _NotInstalled(Exception):
    """A baseline's package does not import here: its rows say "not installed"."""


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _hf_checkpointing(model: torch.nn.Module, on: bool) -> None:
    base = _base(model)
    if on:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_disable()


def _prepare(config: str, model: torch.nn.Module) -> tuple[Callable, dict[str, Any], Callable[[], None]]:
    """Switch `model` to `config`; return its loss function, notes for the rows, and an undo."""
    if config == "hf_gc":
        _hf_checkpointing(model, True)
        return _plain_loss, {}, lambda: _hf_checkpointing(model, False)
    if config == "hf_nogc":
        _hf_checkpointing(model, False)
        return _plain_loss, {}, lambda: None
    if config == "liger":
        try:
            import liger_kernel.transformers as liger
        except ModuleNotFoundError as e:
            if e.name != "liger_kernel":
                raise  # liger is there but one of its own imports failed: an error, not "not installed"
            raise _NotInstalled(f"liger-kernel: {e}") from e
        family = _base(model).config.model_type
        apply = getattr(liger, f"apply_liger_kernel_to_{family}", None)
        if apply is None:
            raise RuntimeError(f"liger-kernel {package_version('liger-kernel')} has no apply_liger_kernel_to_{family}")
        apply(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=True,
            model=_base(model),
        )
        _hf_checkpointing(model, True)
        # liger rebinds functions in transformers' modeling modules: no undo; it runs in its own process.
        return _plain_loss, {"liger": package_version("liger-kernel")}, lambda: None
    if config == "ours":
        from slimtune.kernels.apply import apply_kernels
        from slimtune.train.step import enable_checkpointing

        handle = enable_checkpointing(model, "unsloth")
        patch = apply_kernels(model, "auto", checkpoint_pass=handle.layer_pass)
        notes = {"kernels": patch.modules, "kernels_skipped": patch.skipped, "offloading": handle.offloading}

        def undo() -> None:
            patch.undo()
            handle.undo()

        return ours_loss, notes, undo
    raise ValueError(f"--configs: unknown config {config!r}; choose from {', '.join(CONFIGS)}")


# ---------------------------------------------------------------------------------------------- workers
def _emit(path: Path | None, record: dict[str, Any]) -> None:
    """Append one JSON line (the worker's only channel to the orchestrator) and flush it at once."""
    if path is None:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _recorder(out: Path | None) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """A list of a worker's records and the function that adds one (to the list, the file, the log)."""
    records: list[dict[str, Any]] = []

    def emit(rec: dict[str, Any]) -> None:
        records.append(rec)
        _emit(out, rec)
        if rec["kind"] == "row":
            print(_summary(rec), flush=True)

    return records, emit


def train_worker(
    model_key: str,
    configs: list[str],
    batches: list[int],
    seq: int,
    warmup: int,
    steps: int,
    device: str,
    out: Path | None = None,
    rss_sampler: str = "process",
) -> list[dict[str, Any]]:
    """Build one random NF4 + LoRA model and measure each (config, batch) on it, in order."""
    records, emit = _recorder(out)

    pending = [c for c in configs if c in _NEEDS and importlib.util.find_spec(_NEEDS[c]) is None]
    for c in pending:
        for b in batches:
            emit(make_row(model_key, c, b, seq, "not installed", error=f"{_NEEDS[c]} is not importable"))
    configs = [c for c in configs if c not in pending]
    if not configs:
        return records

    t0 = time.perf_counter()
    import bitsandbytes  # noqa: F401  (import cost is part of setup, not of the first row)
    import peft  # noqa: F401
    import transformers  # noqa: F401

    setup: dict[str, Any] = {
        "kind": "setup",
        "model": model_key,
        "configs": configs,
        "import_s": round(time.perf_counter() - t0, 2),
    }
    t0 = time.perf_counter()
    shape = MODEL_SHAPES[model_key]
    model = build_random_model(shape, device)
    synchronize(device)
    setup["build_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    setup["nf4_layers"] = quantize_nf4_(model)
    synchronize(device)
    setup["quantize_s"] = round(time.perf_counter() - t0, 2)
    model = attach_lora(model)
    setup["trainable_params"] = sum(p.numel() for p in trainable_parameters(model))
    on_gpu = device.startswith("cuda")
    setup["allocated_gib_after_setup"] = gib(torch.cuda.memory_allocated() if on_gpu else None)
    emit(setup)

    for config in configs:
        try:
            loss_fn, notes, undo = _prepare(config, model)
        except _NotInstalled as e:
            for b in batches:
                emit(make_row(model_key, config, b, seq, "not installed", error=str(e)[:ERROR_CHARS]))
            continue
        except Exception as e:
            traceback.print_exc()
            for b in batches:
                emit(make_row(model_key, config, b, seq, "error", error=f"setup: {error_text(e)}"))
            continue
        for b in batches:
            emit(
                measure_training(
                    model,
                    loss_fn,
                    model_key=model_key,
                    config=config,
                    batch=b,
                    seq=seq,
                    warmup=warmup,
                    steps=steps,
                    device=device,
                    notes=notes,
                    rss_sampler=rss_sampler,
                )
            )
        undo()
    del model
    free_memory(device)
    return records


def import_unsloth():
    """Unsloth's `FastLanguageModel`, imported offline; call it before anything imports transformers or peft,
    or Unsloth's patches are skipped. Raises what the import raises (absent, or broken: no GPU)."""
    for var, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("UNSLOTH_DISABLE_STATISTICS", "1"),
    ):
        os.environ.setdefault(var, value)
    from unsloth import FastLanguageModel

    return FastLanguageModel


def load_unsloth_lora(fast_language_model, model_dir: Path, model_key: str, seq: int, rank: int = LORA_RANK):
    """(model, tokenizer): the saved folder loaded by Unsloth, with LoRA of `rank` on the family's projections and
    "unsloth" checkpointing, as Unsloth's notebooks set them up: in 4-bit, except a mixture of experts, which
    Unsloth loads in 16 bits ("MoE QLoRA not recommended due to BitsandBytes limitations") with the notebooks'
    seven projection names, left for Unsloth to map onto its experts."""
    family = FAMILIES.get(MODEL_SHAPES[model_key].family)
    moe = family is not None and family.experts
    model, tokenizer = fast_language_model.from_pretrained(
        model_name=str(model_dir),
        max_seq_length=seq,
        dtype=torch.bfloat16,
        load_in_4bit=not moe,
        fix_tokenizer=False,
        local_files_only=True,
        use_exact_model_name=True,
        use_gradient_checkpointing="unsloth",
    )
    targets = list(LORA_TARGETS) if moe else lora_target_modules(MODEL_SHAPES[model_key].family, list(LORA_TARGETS))
    model = fast_language_model.get_peft_model(
        model,
        r=rank,
        lora_alpha=rank,
        lora_dropout=0,
        bias="none",
        random_state=0,
        max_seq_length=seq,
        target_modules=targets,
        use_gradient_checkpointing="unsloth",
    )
    return model, tokenizer


def unsloth_worker(
    model_key: str,
    batches: list[int],
    seq: int,
    warmup: int,
    steps: int,
    device: str,
    scratch: Path,
    out: Path | None = None,
    model_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Unsloth on the same random weights: it loads from a directory, so save them there first.

    `model_dir`: a saved model to load instead (benchmarks/families_bench.py passes the folder its
    `slimtune run` trained on, so both train the same weights); it is left in place.
    """
    records, emit = _recorder(out)

    t0 = time.perf_counter()
    try:
        FastLanguageModel = import_unsloth()  # before transformers/peft are imported
    except Exception as e:  # absent, or present but broken (Unsloth also raises at import without a GPU)
        status = "not installed" if isinstance(e, ModuleNotFoundError) and e.name == "unsloth" else "error"
        for b in batches:
            emit(make_row(model_key, "unsloth", b, seq, status, error=f"import unsloth: {error_text(e)}"))
        return records
    setup: dict[str, Any] = {
        "kind": "setup",
        "model": model_key,
        "configs": ["unsloth"],
        "import_s": round(time.perf_counter() - t0, 2),
    }

    owned = model_dir is None
    if owned:
        model_dir = scratch / f"unsloth-{model_key}"
        t0 = time.perf_counter()
        model = build_random_model(MODEL_SHAPES[model_key], device)
        model.save_pretrained(str(model_dir), max_shard_size="2GB")
        save_word_tokenizer(model_dir)
        del model
        free_memory(device)
        trim_host_heap()  # the save's host copies should not count in the training rows' RSS
        setup["save_s"] = round(time.perf_counter() - t0, 2)

    t0 = time.perf_counter()
    try:
        model, _tok = load_unsloth_lora(FastLanguageModel, model_dir, model_key, seq)
        FastLanguageModel.for_training(model)
    except Exception as e:
        traceback.print_exc()
        for b in batches:
            emit(make_row(model_key, "unsloth", b, seq, "error", error=f"load: {error_text(e)}"))
        if owned:
            shutil.rmtree(model_dir, ignore_errors=True)
        return records
    setup["load_s"] = round(time.perf_counter() - t0, 2)
    emit(setup)
    if owned:
        shutil.rmtree(model_dir, ignore_errors=True)
    notes = {"unsloth": package_version("unsloth"), "unsloth_zoo": package_version("unsloth_zoo")}
    for b in batches:
        emit(
            measure_training(
                model,
                _plain_loss,
                model_key=model_key,
                config="unsloth",
                batch=b,
                seq=seq,
                warmup=warmup,
                steps=steps,
                device=device,
                notes=notes,
            )
        )
    return records


# ----------------------------------------------------------------------------------------- orchestrator
def _summary(r: dict[str, Any]) -> str:
    head = f"{_ROW_MARK} {r['model']:>6} {r['config']:<8} bs{r['batch']} seq{r['seq']}"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r.get('error')}"
    spread = (
        f"step {r['step_s_min']:.3f}/{r['step_s_median']:.3f}/{r['step_s_max']:.3f} s"
        if "step_s_median" in r
        else f"tok/s {r['tokens_per_s_min']:.0f}..{r['tokens_per_s_max']:.0f} ({r.get('batching')})"
    )
    return (
        f"{head}: {r['tokens_per_s']:.0f} tok/s, {spread}, alloc {r['peak_allocated_gib']} GiB, reserved "
        f"{r['peak_reserved_gib']} GiB, rss {r['host_rss_peak_gib']} GiB, "
        f"loss {r['loss_first']}->{r['loss_last']}"
    )


def _worker_cmd(args: argparse.Namespace, kind: str, rows_out: Path, **extra: str) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        kind,
        "--rows-out",
        str(rows_out),
        "--device",
        args.device,
        "--seq",
        str(args.seq),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--batch",
        ",".join(map(str, args.batch)),
        "--scratch",
        str(args.scratch),
        "--rss-sampler",
        args.rss_sampler,
    ]
    if args.model_root:
        cmd += ["--model-root", str(args.model_root)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", v]
    return cmd


def _spawn(cmd: list[str], rows_out: Path, log: Path, deadline: float) -> dict[str, Any]:
    """Run one worker under the remaining budget; return its records and how it ended."""
    remaining = deadline - time.monotonic()
    info: dict[str, Any] = {"cmd": " ".join(shlex.quote(c) for c in cmd[2:])}
    if remaining < _WORKER_MIN_S:
        return {**info, "rc": None, "ended": "skipped: time budget spent", "records": [], "wall_s": 0.0}
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=remaining)
            ended = "exited" if rc == 0 else f"exit code {rc}"
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child; its GPU memory goes with it
            rc = proc.wait()
            ended = "killed: time budget spent"
    records = []
    if rows_out.exists():
        lines = rows_out.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    text = log.read_text(encoding="utf-8", errors="replace")
    # The device tool returns only the last 12,000 characters of output: echo the row lines, and the
    # log's tail only when the worker failed.
    print("".join(line + "\n" for line in text.splitlines() if line.startswith(_ROW_MARK)), end="")
    if rc != 0:
        print(text[-1500:])
    return {
        **info,
        "rc": rc,
        "ended": ended,
        "records": records,
        "wall_s": round(time.monotonic() - t0, 1),
        "log_tail": text[-1500:] if rc != 0 else "",
    }


def _fill_missing(
    rows: list[dict], model_key: str, configs: list[str], batches: list[int], seq: int, ended: str, log_tail: str
) -> list[dict]:
    """Rows a worker never wrote (crash, kill, budget) become explicit failures, not gaps."""
    have = {(r["config"], r["batch"]) for r in rows}
    status = "timeout" if "budget" in ended else "crashed"
    last = log_tail.strip().splitlines()[-1][:ERROR_CHARS] if log_tail.strip() else ""
    return [
        make_row(model_key, c, b, seq, status, error=f"worker {ended}" + (f"; {last}" if last else ""))
        for c in configs
        for b in batches
        if (c, b) not in have
    ]


def _write(result: dict[str, Any], out: Path) -> None:
    result["rows"] = combine_rounds(result["round_rows"])
    result["ratios"] = compute_ratios(result["rows"])  # kept in the JSON for whoever reads it without us
    write_json_atomic(out / "bench.json", result)
    write_text_atomic(out / "bench.md", render_markdown(result))


def _plan(args: argparse.Namespace) -> list[tuple]:
    """Group-major order (`_GROUPS`), so that a run cut short by the budget still holds complete comparisons;
    merge/GGUF exports run just before Unsloth (the slowest to set up: it imports for ~20 s and must save and
    reload the weights). With `--rounds`, the training groups again per round, every other round in reverse
    order so that a slow spell of the machine does not always fall on the same config; exports run once."""
    plan: list[tuple] = []
    exports = (("prep", args.merge or args.gguf), ("merge", args.merge), ("gguf", args.gguf))
    for rnd in range(args.rounds):
        for group in _GROUPS if rnd % 2 == 0 else _GROUPS[::-1]:
            if group == ("unsloth",) and rnd == 0:
                plan += [("export", step) for step, wanted in exports if wanted]
            configs = [c for c in group if c in args.configs]
            plan += [("train", m, configs, rnd) for m in args.models] if configs else []
    return plan


def _run_training_group(
    args: argparse.Namespace,
    model_key: str,
    configs: list[str],
    rnd: int,
    work: Path,
    deadline: float,
    result: dict[str, Any],
) -> None:
    missing = [c for c in configs if c in _NEEDS and importlib.util.find_spec(_NEEDS[c]) is None]
    if missing == configs:  # nothing to run: say so without paying a worker's start-up
        recs = [
            make_row(model_key, c, b, args.seq, "not installed", error=f"{_NEEDS[c]} is not importable")
            for c in configs
            for b in args.batch
        ]
        worker: dict[str, Any] = {"cmd": "none", "rc": 0, "ended": "exited", "records": recs, "wall_s": 0.0}
    elif args.in_process and configs[0] in PRODUCT_CONFIGS:
        recs, emit = _recorder(None)
        product_worker(
            model_key, configs[0], args.batch, args.seq, args.warmup, args.steps, args.device, args.scratch, emit
        )
        worker = {"cmd": "in-process", "rc": 0, "ended": "exited", "records": recs, "wall_s": None}
    elif args.in_process and "unsloth" not in configs:
        recs = train_worker(
            model_key, configs, args.batch, args.seq, args.warmup, args.steps, args.device, rss_sampler=args.rss_sampler
        )
        worker = {"cmd": "in-process", "rc": 0, "ended": "exited", "records": recs, "wall_s": None}
    else:
        tag = f"{model_key}-{'-'.join(configs)}-r{rnd}"
        rows_out, log = work / f"{tag}.jsonl", work / f"{tag}.log"
        kind = "unsloth" if configs == ["unsloth"] else "product" if configs[0] in PRODUCT_CONFIGS else "train"
        print(f"== {tag}", flush=True)
        worker = _spawn(
            _worker_cmd(args, kind, rows_out, model=model_key, configs=",".join(configs)), rows_out, log, deadline
        )
    records = worker.pop("records")
    rows = [r for r in records if r["kind"] == "row"]
    worker["setup"] = [r for r in records if r["kind"] == "setup"]
    rows += _fill_missing(rows, model_key, configs, args.batch, args.seq, worker["ended"], worker.get("log_tail", ""))
    result["round_rows"] += [{**r, "round": rnd} for r in rows]
    result["workers"].append({"model": model_key, "configs": configs, "round": rnd, **worker})


def _run_export_step(args: argparse.Namespace, step: str, work: Path, deadline: float, result: dict[str, Any]) -> None:
    rows_out, log = work / f"export-{step}.jsonl", work / f"export-{step}.log"
    print(f"== export {step}", flush=True)
    worker = _spawn(_worker_cmd(args, "export", rows_out, step=step, model=args.export_model), rows_out, log, deadline)
    recs = worker.pop("records")
    if not recs:
        recs = [
            {
                "kind": "export",
                "step": step,
                "model": args.export_model,
                "error": worker["ended"],
                "status": "timeout" if "budget" in worker["ended"] else "crashed",
            }
        ]
    result["export"] += recs
    result["workers"].append({"model": args.export_model, "configs": [f"export:{step}"], **worker})


def orchestrate(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run every worker of the plan in turn within the budget, writing the results after each."""
    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result: dict[str, Any] = {
        "schema": 1,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command_line("benchmarks/runner.py", argv),
        "env": environment(args.device),
        "settings": {
            "models": args.models,
            "configs": args.configs,
            "batch": args.batch,
            "seq": args.seq,
            "warmup": args.warmup,
            "steps": args.steps,
            "rounds": args.rounds,
            "lora_rank": LORA_RANK,
            "quant": "nf4 + double quant",
            "autocast": "bf16",
            "optimizer": "AdamW (fused on CUDA)",
            "tokens_per_s": "batch * seq / median timed step; product rows: real (unpadded) tokens / median step "
            "of the train report after warm-up",
        },
        "rows": [],  # one per (model, config, batch, seq): `round_rows` combined (`report.combine_rounds`)
        "round_rows": [],
        "ratios": [],
        "export": [],
        "workers": [],
    }
    work = Path(tempfile.mkdtemp(prefix="bench-work-", dir=args.scratch))
    try:
        for task in _plan(args):
            if task[0] == "train":
                _run_training_group(args, task[1], task[2], task[3], work, deadline, result)
            else:
                _run_export_step(args, task[1], work, deadline, result)
            _write(result, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - started, 1)
    _write(result, out)
    return result


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list]:
    return lambda s: [kind(x.strip()) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models", type=_csv(str), default=["1b", "8b", "qwen7b"], help=f"comma list of {', '.join(MODEL_SHAPES)}"
    )
    p.add_argument("--configs", type=_csv(str), default=list(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--batch", type=_csv(int), default=[1, 4], help="micro-batch sizes, comma list")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile, autotune, allocator)")
    p.add_argument("--steps", type=int, default=5, help="timed steps; tokens/s uses their median")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every training group this many times, alternating the order; rows give the median round",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--budget-s",
        type=float,
        default=560.0,
        help="wall-clock budget for the whole suite; workers still running at its end are killed "
        "and their missing rows recorded as timeout (the device tool allows 600 s a call)",
    )
    p.add_argument("--merge", action="store_true", help="also time slimtune.merge.merge_adapter")
    p.add_argument("--gguf", action="store_true", help="also time slimtune.export.convert_hf_to_gguf (f16)")
    p.add_argument("--export-model", default="1b", help="model shape for --merge/--gguf")
    p.add_argument("--scratch", default=tempfile.gettempdir(), help="where saved models go (deleted after)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the non-Unsloth groups in this process (CPU smoke tests; liger's patches leak)",
    )
    p.add_argument(
        "--rss-sampler",
        choices=("process", "thread"),
        default="process",
        help="host RSS sampling in a child process (default) or an in-process thread (the old way, to compare)",
    )
    p.add_argument(
        "--model-root",
        help="Unsloth loads ROOT/model-<key> (saved by calibrate_memory.py's build) instead of building its own",
    )
    p.add_argument("--worker", choices=("train", "unsloth", "product", "export"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--rows-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [m for m in args.models if m not in MODEL_SHAPES] + [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown model/config {bad}; models: {', '.join(MODEL_SHAPES)}; configs: {', '.join(CONFIGS)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    scratch = Path(args.scratch)
    rows_out = Path(args.rows_out) if args.rows_out else None
    if args.worker == "train":
        train_worker(
            args.model,
            args.configs,
            args.batch,
            args.seq,
            args.warmup,
            args.steps,
            args.device,
            rows_out,
            args.rss_sampler,
        )
        return 0
    if args.worker == "product":
        _records, emit = _recorder(rows_out)
        product_worker(
            args.model, args.configs[0], args.batch, args.seq, args.warmup, args.steps, args.device, scratch, emit
        )
        return 0
    if args.worker == "unsloth":
        model_dir = Path(args.model_root) / f"model-{args.model}" if args.model_root else None
        unsloth_worker(
            args.model, args.batch, args.seq, args.warmup, args.steps, args.device, scratch, rows_out, model_dir
        )
        return 0
    if args.worker == "export":
        from benchmarks.export_steps import export_step

        _emit(rows_out, export_step(args.step, args.model, args.device, scratch))
        return 0
    result = orchestrate(args, argv)
    ok = sum(r["status"] == "ok" for r in result["rows"])
    print(
        f"\n{ok}/{len(result['rows'])} rows ok in {result['wall_s']} s; "
        f"wrote {Path(args.out) / 'bench.json'} and bench.md\n"
    )
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
