#!/usr/bin/env python3
"""Real-size Gemma-3-1B and Phi-3-mini shapes (random weights) through `slimtune run`, next to Unsloth, in one command.

Per model, each step in its own process (each starts with an empty GPU):
1. calibrate_memory.py's build worker saves random bf16 weights as safetensors with the tiny tokenizer;
2. `slimtune run SPEC`, as a user runs it: load_4bit -> attach_lora (`train.kernels: auto`, "unsloth"
   checkpointing) -> packed_sft -> merge -> GGUF f16, verified in llama.cpp where `llama_cpp` imports (the
   row says when it did not); the row's figures come from the run's own files (train_report.json,
   memory/<stage>.json, report.json);
3. runner.py's Unsloth worker (FastLanguageModel, "unsloth" checkpointing, LoRA on the family's projections)
   trains the same saved folder at the same micro-batch x sequence, warm-up and timed steps.

tokens/s: slimtune's is the median of its train report's per-step figures after warm-up (real tokens of
packed chat rows); Unsloth's is batch x seq over its median timed step (full rows of random ids), as in
runner.py. Peak memory: the allocator peak of slimtune's packed_sft stage (the guard's record) and of
Unsloth's steps; the whole flow's peak over all stages is recorded as well.

Usage (device): python3 benchmarks/families_bench.py --out "$OUT"
CPU check of the harness: python3 benchmarks/families_bench.py --device cpu --models tiny_gemma3,tiny_phi3 \
    --batch 1 --seq 256 --out /tmp/fam-out
Writes OUT/families.json (rows, environment), OUT/families.md (the table) and OUT/logs/ (each step's output).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `benchmarks`, `slimtune`

from benchmarks.common import (
    MODEL_SHAPES,
    REPO_ROOT,
    environment,
    gib,
    make_row,
    run_process,
    write_json_atomic,
    write_text_atomic,
)
from benchmarks.product import report_stats, write_chat_data

GiB = 1024**3
UNSLOTH_S = 110.0  # runner.py's Unsloth worker on an H100: 112-115 s for the 1B and 8B shapes at batch 1 and 4


def _spec(key: str, root: Path, args: argparse.Namespace, verify: bool) -> dict[str, Any]:
    return {
        "name": f"families-{key}",
        "output_dir": str(root / "runs"),
        "model": {"name_or_path": str(root / f"model-{key}"), "device": args.device},
        "lora": {"r": 16, "alpha": 16, "dropout": 0.0, "gradient_checkpointing": "unsloth"},
        "data": {
            "path": str(root / "chat.jsonl"),
            "format": "messages",
            "max_seq_length": args.seq,
            "eval_fraction": 0.0,
        },
        "train": {
            "micro_batch_size": args.batch,
            "gradient_accumulation_steps": 1,
            "max_steps": args.warmup + args.steps,
            "save_steps": 100000,
            "logging_steps": 1,
            "kernels": "auto",
        },
        "merge": {"enabled": True},
        "export": {"gguf": ["f16"], "verify": verify},
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def run_stages(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per stage of a `slimtune run`, from the guard's records (run_dir/memory/<stage>.json): seconds, GPU and
    host peaks in GiB, outcome."""
    stages = {}
    for f in sorted((run_dir / "memory").glob("*.json")):
        rec = json.loads(f.read_text())
        stages[f.stem] = {
            "seconds": round(rec.get("seconds") or 0, 1),
            "peak_allocated_gib": gib(rec.get("peak_gpu_allocated")),
            "peak_reserved_gib": gib(rec.get("peak_gpu_reserved")),
            "peak_device_used_gib": gib(rec.get("peak_device_used")),
            "host_rss_peak_gib": gib(rec.get("peak_host_rss")),
            "outcome": rec.get("outcome"),
        }
    return stages


def run_row(key: str, root: Path, logs: Path, args: argparse.Namespace, verify: bool, timeout: float) -> dict[str, Any]:
    """`slimtune run` on the saved model; the row's figures from the run directory's own files."""
    spec = _spec(key, root, args, verify)
    spec_path = root / f"{spec['name']}.json"
    spec_path.write_text(json.dumps(spec))
    run_dir = root / "runs" / spec["name"]
    shutil.rmtree(run_dir, ignore_errors=True)  # a re-run must not resume the previous one's checkpoint
    t0 = time.monotonic()
    proc = run_process(
        [sys.executable, "-m", "slimtune.cli.main", "run", str(spec_path)], timeout, logs / f"{key}-run.log"
    )
    rc, tail = proc["rc"], proc["tail"]
    seconds = round(time.monotonic() - t0, 1)
    status = "ok" if rc == 0 else "timeout" if rc is None else "error"
    row = make_row(key, "slimtune_run", args.batch, args.seq, status, warmup=args.warmup, wall_s=seconds)
    if rc != 0:
        row["error"] = (tail.strip().splitlines() or [""])[-1][:400]
        row["log_tail"] = tail
    train = _read_json(run_dir / "train_report.json")
    if train:
        try:
            row.update(report_stats(SimpleNamespace(**train), args.warmup))
        except RuntimeError as e:  # no step after warm-up: the row says so, the other model still runs
            row.update(status="error", error=str(e)[:400])
    row["stages"] = stages = run_stages(run_dir)
    sft = stages.get("packed_sft") or {}
    row.update(peak_allocated_gib=sft.get("peak_allocated_gib"), peak_reserved_gib=sft.get("peak_reserved_gib"))
    peaks = [s["peak_allocated_gib"] for s in stages.values() if s["peak_allocated_gib"] is not None]
    row["flow_peak_allocated_gib"] = max(peaks) if peaks else None
    report = _read_json(run_dir / "report.json") or {}
    lora = report.get("attach_lora") or {}
    row["kernels"] = lora.get("kernels")
    row["kernels_skipped"] = lora.get("kernels_skipped")
    row["gguf"] = report.get("gguf_convert_and_push")
    row["gguf_verified_in_llama_cpp"] = verify
    return row


def unsloth_rows(keys: list[str], root: Path, sub: Path, args: argparse.Namespace, budget: float) -> list[dict]:
    """runner.py's Unsloth worker on each saved model (runner.py as a user runs it, within `budget` s; its
    bench.json and bench.md go to `sub`)."""
    if budget < 30:
        return [make_row(k, "unsloth", args.batch, args.seq, "timeout", error="time budget spent") for k in keys]
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "runner.py"), "--models", ",".join(keys)]
    cmd += ["--configs", "unsloth"]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps"]
    cmd += [str(args.steps), "--device", args.device, "--out", str(sub), "--budget-s", str(int(budget - 10))]
    cmd += ["--scratch", str(root), "--model-root", str(root)]
    tail = run_process(cmd, budget, sub.parent / "logs" / f"{sub.name}.log")["tail"]
    bench = _read_json(sub / "bench.json")
    if bench is None:
        return [
            make_row(k, "unsloth", args.batch, args.seq, "crashed", error=tail.strip()[-400:], log_tail=tail)
            for k in keys
        ]
    return bench["rows"]


def _gguf_cell(gguf: dict[str, Any] | None) -> str:
    """GGUF f16 size and llama.cpp's agreement with the merged model, or why there is none."""
    if not gguf or not gguf.get("files"):
        return "–"
    name, size = next(iter(gguf["files"].items()))
    check = (gguf.get("verification") or {}).get(name)
    if not check:
        return f"{size / GiB:.2f} GiB, not verified (no llama_cpp)"
    return (
        f"{size / GiB:.2f} GiB, llama.cpp argmax {check['argmax_agreement']:.3f}, "
        f"token ids {'equal' if check['token_ids_equal'] else 'differ'}"
    )


def render(result: dict[str, Any]) -> str:
    """One line per (model, path): tokens/s, peak memory, loss, and slimtune's kernels and export."""
    names = {k: s.name for k, s in MODEL_SHAPES.items()}
    lines = [
        f'micro-batch {result["settings"]["batch"]} x {result["settings"]["seq"]}, LoRA r=16, NF4, "unsloth" '
        f"checkpointing; {result['settings']['warmup']} warm-up + {result['settings']['steps']} timed steps. "
        "slimtune tokens/s: real tokens of packed chat rows (train report, median after warm-up); Unsloth: "
        "batch x seq of random ids over the median step. Peak GiB: allocator peak while training.",
        "",
        "| model | path | tokens/s | peak alloc GiB | peak reserved GiB | whole-flow peak alloc GiB | "
        "loss first → last | kernels | GGUF f16 | status |",
        "|---|---|---:|---:|---:|---:|---|---|---|---|",
    ]

    def cell(v: Any) -> str:
        return "–" if v is None else f"{v:,.0f}" if isinstance(v, float) and v >= 1000 else str(v)

    for r in result["rows"]:
        ok = r["status"] == "ok"
        status = "ok" if ok else f"{r['status']}: {' '.join(str(r.get('error')).split())[:160]}".replace("|", "/")
        if r["config"] == "slimtune_run":
            gguf = _gguf_cell(r.get("gguf"))
            kernels = ", ".join(sorted(r.get("kernels") or {})) or "none"
        else:
            gguf = kernels = "–"
        loss = f"{r.get('loss_first')} → {r.get('loss_last')}" if r.get("loss_first") is not None else "–"
        lines.append(
            f"| {names.get(r['model'], r['model'])} | {r['config']} | {cell(r.get('tokens_per_s'))} | "
            f"{cell(r.get('peak_allocated_gib'))} | {cell(r.get('peak_reserved_gib'))} | "
            f"{cell(r.get('flow_peak_allocated_gib'))} | {loss} | {kernels} | {gguf} | {status} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gemma3_1b,phi3_mini", help=f"comma list of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--root", default="/tmp/families", help="scratch: saved models, data, runs")
    p.add_argument("--out", default=os.environ.get("OUT", "families_out"))
    p.add_argument("--budget-s", type=float, default=500.0, help="wall-clock budget of the whole command")
    p.add_argument("--no-unsloth", action="store_true", help="skip the Unsloth rows")
    args = p.parse_args(argv)
    keys = [k for k in args.models.split(",") if k]
    bad = [k for k in keys if k not in MODEL_SHAPES]
    if bad:
        p.error(f"--models: unknown {bad}; choose from {', '.join(MODEL_SHAPES)}")
    deadline = time.monotonic() + args.budget_s
    root, out = Path(args.root), Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)  # every step's output, for when a row says error
    verify = importlib.util.find_spec("llama_cpp") is not None
    tokens = int(1.5 * args.batch * args.seq * (args.warmup + args.steps))
    write_chat_data(root / "chat.jsonl", tokens_needed=tokens)
    result: dict[str, Any] = {
        "env": environment(args.device),
        "settings": {k: getattr(args, k) for k in ("models", "batch", "seq", "warmup", "steps", "device")},
        "llama_cpp": verify,
        "rows": [],
        "build": {},
    }
    # Model by model (slimtune, then Unsloth), so that a run cut short by the budget still holds whole pairs;
    # each slimtune run leaves Unsloth the seconds its worker took on the 1B/8B shapes (import, load, steps).
    reserve = 0.0 if args.no_unsloth else UNSLOTH_S
    for key in keys:
        t0 = time.monotonic()
        cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "calibrate_memory.py"), "--worker", "build"]
        cmd += ["--models", key]
        cmd += ["--root", str(root), "--out", str(out), "--device", args.device]
        proc = run_process(cmd, max(deadline - time.monotonic() - reserve, 1), out / "logs" / f"{key}-build.log")
        rc, tail = proc["rc"], proc["tail"]
        result["build"][key] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}
        print(f"built {key}: rc {rc} in {result['build'][key]['seconds']} s", flush=True)
        if rc != 0:
            result["rows"].append(make_row(key, "slimtune_run", args.batch, args.seq, "error", error=tail[-400:]))
            continue
        row = run_row(key, root, out / "logs", args, verify, max(deadline - time.monotonic() - reserve, 1))
        print(json.dumps({k: row.get(k) for k in ("model", "status", "tokens_per_s", "peak_allocated_gib")}))
        result["rows"].append(row)
        shutil.rmtree(root / "runs" / f"families-{key}", ignore_errors=True)  # merged weights + GGUF: disk
        if not args.no_unsloth:
            result["rows"] += unsloth_rows([key], root, out / f"unsloth-{key}", args, deadline - time.monotonic())
        write_json_atomic(out / "families.json", result)
        write_text_atomic(out / "families.md", render(result))
    write_json_atomic(out / "families.json", result)
    write_text_atomic(out / "families.md", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
