#!/usr/bin/env python3
"""The comparison users make: one chat dataset, one model, the same optimizer steps, through three tools.

Each tool runs in its own process (an empty GPU, its own host memory), on the same saved random bf16 weights
(calibrate_memory.py's build worker: safetensors shards + the tiny tokenizer) and the same chat JSONL
(product.py's `write_chat_data`: skewed lengths), with the same LoRA (r=16, alpha 16, no dropout, the seven
projections), AdamW (`adamw_torch`), lr 2e-4 cosine without warm-up, gradient clipping 1.0, seed 0, bf16,
micro-batch x max length, no accumulation, and the loss on every token (TRL's default for chat data, so
slimtune's spec sets `data.completion_only_loss: false`):

  slimtune  `slimtune run SPEC`, the CLI as a user runs it (packing, "unsloth" checkpointing, kernels auto;
            merge and GGUF export off: training is what is compared). Figures from the run's own files.
  unsloth   Unsloth `FastLanguageModel.from_pretrained(load_in_4bit=True)` + `get_peft_model` ("unsloth"
            checkpointing) + TRL `SFTTrainer` with `packing=True`, as Unsloth's notebooks do.
  hf_trl    transformers + bitsandbytes NF4 (double quant) + peft LoRA (`peft_config`) + TRL `SFTTrainer`,
            `packing=True, padding_free=True`, gradient checkpointing; flash_attention_2 where `flash_attn`
            imports, else SDPA (`--hf-attn`).

Per tool: wall time of the whole process (imports, loading, data preparation, training, saving), training time
(the `Trainer.train()` call), real tokens trained (padding excluded) / training time, the steady rate (median of
the per-step rates after `--warmup` steps: slimtune's train report; for TRL a callback that synchronizes and
times each step, and a collator wrapper that counts each batch's tokens), peak GPU allocated and reserved
while training (slimtune: its packed_sft stage's guard record) and over the whole process, peak host RSS of
the process tree (the kernel's ru_maxrss from wait4: the largest process, not a sum), first and final loss.
A tool that is not installed, fails or runs past `--timeout-s` gives a row saying so.

Usage (device): python3 benchmarks/user_compare.py --model 1b --out "$OUT"   [--tools slimtune,hf_trl]
CPU check: python3 benchmarks/user_compare.py --device cpu --model tiny --seq 256 --steps 3 --warmup 1 \
    --tools slimtune,hf_trl --out /tmp/usercmp-out
Writes OUT/user_compare.json (rows, environment, settings, command), OUT/user_compare.md (the table) and
OUT/logs/ (each process's output).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `benchmarks`, `slimtune`

from benchmarks import trl_sft
from benchmarks.common import (
    LORA_RANK,
    LORA_TARGETS,
    MODEL_SHAPES,
    REPO_ROOT,
    SEED,
    command_line,
    environment,
    gib,
    make_row,
    run_process,
    write_json_atomic,
    write_text_atomic,
)
from benchmarks.families_bench import run_stages
from benchmarks.product import report_stats, write_chat_data
from benchmarks.trl_sft import LEARNING_RATE, LR_SCHEDULE, MAX_GRAD_NORM, NEEDS, OPTIMIZER
from slimtune.models.families import FAMILIES

# the default rows; bf16_experts, for a mixture of experts only: slimtune's own tasks with its experts in bf16, the
# reference its loss is held to (moe_reference.py)
USER_TOOLS = ("slimtune", *trl_sft.TOOLS)
TOOLS = (*USER_TOOLS, "bf16_experts")
_MIN_START_S = 30  # a tool is not started with less of the budget left than this
_SETTINGS = (
    "model",
    "tools",
    "device",
    "batch",
    "seq",
    "steps",
    "warmup",
    "gpu_budget_gib",
    "match_card_of",
    "lora_r",
    "set",
)
LOSS_TOLERANCE = 0.01  # issue 43: NF4 experts' loss within 1% of the bf16-expert reference's at every step


def slimtune_spec(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The spec a user would write for this comparison (merge and GGUF off: training is compared)."""
    return {
        "name": f"usercmp-{args.model}",
        "output_dir": str(root / "runs"),
        "model": {"name_or_path": str(root / f"model-{args.model}"), "device": args.device},
        "lora": {
            "r": args.lora_r,
            "alpha": args.lora_r,
            "dropout": 0.0,
            "target_modules": list(LORA_TARGETS),
            "gradient_checkpointing": "unsloth",
        },
        "data": {
            "path": str(root / "chat.jsonl"),
            "format": "messages",
            "max_seq_length": args.seq,
            "packing": "packed",
            "completion_only_loss": False,
            "eval_fraction": 0.0,
        },
        "train": {
            **(
                {"micro_batch_size": "auto", "effective_batch_size": args.batch}
                if args.gpu_budget_gib
                else {"micro_batch_size": args.batch, "gradient_accumulation_steps": 1}
            ),
            "max_steps": args.steps,
            "learning_rate": LEARNING_RATE,
            "lr_scheduler": LR_SCHEDULE,
            "warmup_steps": 0,
            "optimizer": OPTIMIZER,
            "max_grad_norm": MAX_GRAD_NORM,
            "precision": "bf16" if args.device.startswith("cuda") else "auto",
            "seed": SEED,
            "logging_steps": 1,
            "save_steps": 100000,
            "kernels": "auto",
        },
        "merge": {"enabled": False},
        "export": {"gguf": []},
    } | (_budgeted(args) if args.gpu_budget_gib else {})


def _budgeted(args: argparse.Namespace) -> dict[str, Any]:
    """--gpu-budget-gib: the run held to a card of that size (device-wide), the micro-batch chosen by `auto` among
    the divisors of --batch (the effective batch), as a user with that card would set it."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    return {"guard": {"gpu_memory_fraction": round(args.gpu_budget_gib * 2**30 / total, 4)}}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


def _steady(row: dict[str, Any], report: SimpleNamespace, warmup: int) -> None:
    """Steady-state and loss fields from a train-report-like record (product.py's definition, renamed:
    `tokens_per_s` here is real tokens / training seconds, `steady_tokens_per_s` the median step after warm-up)."""
    try:
        stats = report_stats(report, warmup)
    except RuntimeError as e:  # no step after warm-up
        row["steady_error"] = str(e)[:400]
        if report.losses:
            row.update(loss_first=round(report.losses[0]["loss"], 4), loss_last=round(report.losses[-1]["loss"], 4))
        return
    stats["steady_tokens_per_s"] = stats.pop("tokens_per_s")
    stats.pop("report_tokens_per_s")
    row.update(stats)
    keep = ("step", "loss", "tokens_per_s")  # the loss curve, to compare tools from the same init
    row["losses"] = [{k: e.get(k) for k in keep} for e in report.losses]


def slimtune_row(args: argparse.Namespace, root: Path, logs: Path, timeout: float) -> dict[str, Any]:
    """`slimtune run` on the saved model; figures from the run directory's own files."""
    spec = slimtune_spec(args, root)
    spec_path = root / f"{spec['name']}.json"
    spec_path.write_text(json.dumps(spec))
    run_dir = root / "runs" / spec["name"]
    shutil.rmtree(run_dir, ignore_errors=True)  # a re-run must not resume or reuse the previous run
    cmd = [sys.executable, "-m", "slimtune.cli.main", "run", str(spec_path)]
    cmd += [arg for field in args.set for arg in ("--set", field)]
    proc = run_process(cmd, timeout, logs / "slimtune.log")
    row = _base_row(args, "slimtune", proc)
    train_path = run_dir / "train_report.json"
    if train_path.is_file():
        train = json.loads(train_path.read_text())
        row.update(steps=train["steps"], train_s=round(train["training_seconds"], 2), tokens=train["tokens_seen"])
        row["tokens_per_s"] = round(train["tokens_per_s"], 1)
        row["optimizer"] = train["optimizer"]  # as resolved for the device; each TRL row records its own
        row["micro_batch_x_accumulation"] = f"{train['micro_batch_size']} x {train['gradient_accumulation_steps']}"
        row["stored_layers"] = train.get("stored_layers", 0)  # the last layers that kept their activations
        _steady(row, SimpleNamespace(**train), args.warmup)
    stages = run_stages(run_dir)
    sft = stages.get("packed_sft") or {}
    row.update(peak_allocated_gib=sft.get("peak_allocated_gib"), peak_reserved_gib=sft.get("peak_reserved_gib"))
    for key in ("allocated", "reserved"):
        peaks = [s[f"peak_{key}_gib"] for s in stages.values() if s[f"peak_{key}_gib"] is not None]
        row[f"process_peak_{key}_gib"] = max(peaks) if peaks else None
    row["stages"] = stages
    report_path = run_dir / "report.json"
    if report_path.is_file():
        lora = json.loads(report_path.read_text()).get("attach_lora") or {}
        row.update(kernels=lora.get("kernels"), kernels_skipped=lora.get("kernels_skipped"))
        row["trainable_parameters"] = lora.get("trainable_parameters")
    return _check_steps(row, args.steps)


def _base_row(args: argparse.Namespace, tool: str, proc: dict[str, Any]) -> dict[str, Any]:
    status = "ok" if proc["rc"] == 0 else "timeout" if proc["rc"] is None else "error"
    row = make_row(args.model, tool, args.batch, args.seq, status, warmup=args.warmup)
    row.update(wall_s=proc["wall_s"], host_rss_peak_gib=gib(proc["host_rss_peak"]))
    row["card_peak_gib"] = gib(proc["card_peak"]) if proc["card_peak"] is not None else None
    if status == "timeout":
        row["error"] = f"killed after {proc['wall_s']} s (--timeout-s or the budget); last output: " + _last_line(
            proc["tail"]
        )
    elif status == "error":
        row["error"] = _last_line(proc["tail"])
    if status != "ok":
        row["log_tail"] = proc["tail"]
    return row


def _check_steps(row: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run that trained another number of steps, or to a non-finite loss, is not a figure to compare."""
    losses = [e["loss"] for e in row.get("losses") or []]
    if row["status"] == "ok" and row.get("steps") != steps:
        row.update(status="error", error=f"trained {row.get('steps')} optimizer steps, not {steps}")
    elif row["status"] == "ok" and not all(math.isfinite(x) for x in losses):
        row.update(status="error", error=f"non-finite loss: {losses}")
    return row


def trl_row(tool: str, args: argparse.Namespace, root: Path, logs: Path, timeout: float) -> dict[str, Any]:
    """One TRL-based tool in its own process (benchmarks/trl_sft.py); the figures come from its result file."""
    missing = [m for m in NEEDS[tool] if importlib.util.find_spec(m) is None]
    if missing:
        return make_row(args.model, tool, args.batch, args.seq, "not installed", error=f"no module {missing}")
    result_path = root / f"{tool}.result.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, trl_sft.__file__, "--tool", tool, "--model", args.model, "--device", args.device]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--root", str(root)]
    cmd += ["--hf-attn", args.hf_attn, "--lora-r", str(args.lora_r)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if not args.device.startswith("cuda"):  # TRL 1.15's SFTTrainer always computes the loss in a Triton kernel
        env["TRITON_INTERPRET"] = "1"  # (trl/kernels/chunked_logprob.py), which has no CPU driver otherwise
    proc = run_process(cmd, timeout, logs / f"{tool}.log", env, cwd=root)  # Unsloth compiles into ./
    row = _base_row(args, tool, proc)
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        report = result.pop("report", None)
        if result.get("status") not in (None, "ok"):  # the worker's own verdict names the cause
            row.update(status=result.pop("status"), error=result.pop("error"))
        row.update({k: v for k, v in result.items() if k not in ("status", "error")})
        if report is not None:
            _steady(row, SimpleNamespace(**report), args.warmup)
    elif row["status"] == "ok":
        row.update(status="error", error="the worker wrote no result")
    return _check_steps(row, args.steps)


def bf16_experts_row(args: argparse.Namespace, root: Path, logs: Path, timeout: float) -> dict[str, Any]:
    """The bf16-expert reference (benchmarks/moe_reference.py) in its own process, on slimtune's spec."""
    spec_path = root / "bf16-experts-spec.json"
    spec_path.write_text(json.dumps(slimtune_spec(args, root)))
    result_path = root / "bf16_experts.result.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "moe_reference.py"), "--spec", str(spec_path)]
    proc = run_process(cmd + ["--out", str(result_path)], timeout, logs / "bf16_experts.log")
    row = _base_row(args, "bf16_experts", proc)
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        report = result["report"]
        row.update(steps=result["steps"], train_s=round(report["training_seconds"], 2), tokens=report["tokens_seen"])
        row.update(tokens_per_s=round(report["tokens_per_s"], 1), peak_allocated_gib=result.get("peak_allocated_gib"))
        row["dense_layers"] = result["dense_layers"]
        _steady(row, SimpleNamespace(**report), args.warmup)
    elif row["status"] == "ok":
        row.update(status="error", error="the worker wrote no result")
    return _check_steps(row, args.steps)


def loss_gap(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """slimtune's loss against the bf16-expert reference's, step by step: the largest |difference| / reference."""
    by_tool = {r["config"]: r for r in rows if r["status"] == "ok" and r.get("losses")}
    if not {"slimtune", "bf16_experts"} <= set(by_tool):
        return None
    ours, ref = by_tool["slimtune"]["losses"], by_tool["bf16_experts"]["losses"]
    gaps = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ours, ref, strict=True)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {
        "steps": len(gaps),
        "max_relative": round(gaps[worst], 5),
        "at_step": ours[worst]["step"],
        "tolerance": LOSS_TOLERANCE,
        "within": gaps[worst] <= LOSS_TOLERANCE,
    }


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and v >= 1000:
        return f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def render(result: dict[str, Any]) -> str:
    """The markdown table: one line per tool, then the command that made it."""
    s = result["settings"]
    family = FAMILIES.get(MODEL_SHAPES[s["model"]].family)
    storage = "NF4 (Unsloth: experts in 16 bits)" if family and family.experts else "NF4"
    lines = [
        f"{MODEL_SHAPES[s['model']].name} shape (random weights), micro-batch {s['batch']} x {s['seq']}, "
        f"{s['steps']} optimizer steps, LoRA r={s['lora_r']} on the 7 projections, {storage}. tokens/s: real tokens / "
        f"training seconds; steady: median step after {s['warmup']} warm-up steps. GPU peaks while training "
        "(whole process in brackets); host RSS: the process tree's peak.",
        "",
        "| tool | status | wall s | train s | real tokens | tokens/s | steady tokens/s | peak alloc GiB | "
        "peak reserved GiB | card peak GiB | host RSS GiB | loss first → final |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {' '.join(str(r.get('error')).split())}"
        loss = f"{r['loss_first']} → {r['loss_last']}" if r.get("loss_first") is not None else "–"
        alloc = f"{_cell(r.get('peak_allocated_gib'))} ({_cell(r.get('process_peak_allocated_gib'))})"
        reserved = f"{_cell(r.get('peak_reserved_gib'))} ({_cell(r.get('process_peak_reserved_gib'))})"
        cells = [r["config"], status.replace("|", "/")[:200], _cell(r.get("wall_s")), _cell(r.get("train_s"))]
        cells += [_cell(r.get("tokens")), _cell(r.get("tokens_per_s")), _cell(r.get("steady_tokens_per_s"))]
        cells += [alloc, reserved, _cell(r.get("card_peak_gib")), _cell(r.get("host_rss_peak_gib")), loss]
        lines.append("| " + " | ".join(cells) + " |")
    gap = result.get("loss_vs_bf16_experts")
    if gap:
        lines += [
            "",
            f"slimtune's loss against the bf16-expert reference over {gap['steps']} steps: at most "
            f"{gap['max_relative']:.2%} apart (step {gap['at_step']}; tolerance {gap['tolerance']:.0%}).",
        ]
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def _write(result: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "user_compare.json", result)
    write_text_atomic(out / "user_compare.md", render(result))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1b", help=f"one of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--tools", default=",".join(USER_TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=4, help="micro-batch (rows of --seq tokens)")
    p.add_argument("--seq", type=int, default=2048, help="max_seq_length / max_length")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps, no accumulation")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady rate")
    p.add_argument("--lora-r", type=int, default=LORA_RANK, help="LoRA rank of every tool (alpha the same)")
    p.add_argument("--hf-attn", default="auto", help="hf_trl's attn_implementation (auto: flash_attention_2 or sdpa)")
    p.add_argument("--timeout-s", type=float, default=220.0, help="per tool")
    p.add_argument(
        "--gpu-budget-gib", type=float, default=None, help="slimtune held to a card of this size, micro-batch auto"
    )
    p.add_argument(
        "--match-card-of",
        default=None,
        choices=trl_sft.TOOLS,
        help="run that tool first and hold slimtune to the card peak it measured (the same memory: who is faster)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="slimtune's spec field (`slimtune run --set`, repeatable), e.g. train.cuda_graphs=false",
    )
    p.add_argument("--budget-s", type=float, default=500.0, help="the whole command, model build included")
    p.add_argument("--root", default="/tmp/user-compare", help="scratch: the saved model, the data, the runs")
    p.add_argument("--out", default=os.environ.get("OUT", "user_compare_out"))
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    problems = []
    if args.model not in MODEL_SHAPES:
        problems.append(f"--model {args.model}: unknown; choose from {', '.join(MODEL_SHAPES)}")
    if not tools or any(t not in TOOLS for t in tools):
        problems.append(f"--tools {args.tools}: choose from {', '.join(TOOLS)}")
    if not 0 <= args.warmup < args.steps:
        problems.append(f"--warmup {args.warmup}: must be at least 0 and less than --steps {args.steps}")
    if args.match_card_of and (args.gpu_budget_gib or args.match_card_of not in tools or "slimtune" not in tools):
        problems.append(f"--match-card-of {args.match_card_of}: needs it and slimtune in --tools, no --gpu-budget-gib")
    family = FAMILIES.get(MODEL_SHAPES[args.model].family) if args.model in MODEL_SHAPES else None
    if "bf16_experts" in tools and not (family and family.experts):
        problems.append(f"--tools bf16_experts: only for a mixture of experts, not --model {args.model}")
    if problems:
        p.error("; ".join(problems))
    if args.match_card_of:  # measured first, so slimtune can be held to its card
        tools.sort(key=lambda t: t != args.match_card_of)
    args.tool_list = tools
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    root, out = Path(args.root).resolve(), Path(args.out).resolve()  # the TRL workers run in `root`
    root.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    write_chat_data(root / "chat.jsonl", tokens_needed=int(1.5 * args.batch * args.seq * args.steps))
    result: dict[str, Any] = {
        "env": environment(args.device),
        "settings": {k: getattr(args, k) for k in _SETTINGS}
        | {"learning_rate": LEARNING_RATE, "lr_schedule": LR_SCHEDULE},
        "command": command_line("benchmarks/user_compare.py", argv),
        "rows": [],
    }
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "calibrate_memory.py"), "--worker", "build", "--models"]
    cmd += [args.model, "--root", str(root), "--out", str(out), "--device", args.device]
    build = run_process(cmd, max(deadline - time.monotonic(), 1), logs / "build.log")
    result["build"] = {k: build[k] for k in ("rc", "wall_s")}
    print(f"model {args.model}: rc {build['rc']} in {build['wall_s']} s", flush=True)
    for tool in args.tool_list:
        left = deadline - time.monotonic()
        if build["rc"] != 0:
            error = "model build: " + _last_line(build["tail"])
            row = make_row(args.model, tool, args.batch, args.seq, "error", error=error)
        elif left < _MIN_START_S:
            row = make_row(args.model, tool, args.batch, args.seq, "timeout", error="not started: time budget spent")
        elif tool == "slimtune":
            row = slimtune_row(args, root, logs, min(args.timeout_s, left))
        elif tool == "bf16_experts":
            row = bf16_experts_row(args, root, logs, min(args.timeout_s, left))
        else:
            row = trl_row(tool, args, root, logs, min(args.timeout_s, left))
        shown = ("config", "status", "error", "wall_s", "tokens_per_s", "steady_tokens_per_s", "peak_allocated_gib")
        print(json.dumps({k: row.get(k) for k in shown}), flush=True)
        result["rows"].append(row)
        result["loss_vs_bf16_experts"] = loss_gap(result["rows"])
        if tool == args.match_card_of and row.get("card_peak_gib"):
            args.gpu_budget_gib = result["settings"]["gpu_budget_gib"] = row["card_peak_gib"]
        _write(result, out)  # after every tool: a call cut short keeps what finished
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
