"""Scaling through `slimtune run`: one GPU, two GPUs on torchrun (`train.num_gpus: 2`), two Ray workers
(`train.cluster`, a Ray head started here with `ray start --head`), on the same random-weight model and data.

Every run is the product path (the CLI, the Prefect flow, load -> attach -> packed_sft), merge and GGUF off. The
per-GPU work is the same in each: micro-batch 4 x 2048; the one-GPU runs accumulate 2 micro-batches per step so
that every optimizer step sees the same rows as the two-GPU runs'. The one-GPU run is measured twice: with the
step settings every rank of a multi-GPU run has (stored_layers 0, CUDA graphs off: `scaling` divides by it) and
with its own defaults (stored layers and graphs where the card holds them: `vs_one_gpu_defaults`).
Speed is the train report's steady rate: the median of the logged per-step tokens/s after `--warmup` steps (under
DDP the logged rate counts every rank's tokens).

    python benchmarks/ray_scaling.py --shape 8b --steps 14 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))

from benchmarks.calibrate_memory import build_model  # noqa: E402
from benchmarks.common import command_line, environment, write_json_atomic  # noqa: E402


def write_data(root: Path, rows: int) -> Path:
    """Plain text rows of ~3,000 words (the tiny tokenizer's): packed into full 2048-token rows."""
    path = root / f"scaling-{rows}.jsonl"
    rng = random.Random(0)
    words = "the model learns from packed rows of text without padding between examples across machines".split()
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(3000))}) + "\n")
    return path


def _spec(model: Path, data: Path, runs: Path, name: str, steps: int, **train: object) -> dict:
    return {
        "name": name,
        "output_dir": str(runs),
        "model": {"name_or_path": str(model), "device": "auto"},
        "lora": {"r": 16, "alpha": 16, "dropout": 0.0, "gradient_checkpointing": "unsloth"},
        "data": {"path": str(data), "format": "text", "max_seq_length": 2048, "eval_fraction": 0.0},
        "train": {"micro_batch_size": 4, "max_steps": steps, "save_steps": 1000, "lr_scheduler": "constant", **train},
        "merge": {"enabled": False},
        "export": {"gguf": []},
    }


def _run(root: Path, raw: dict, warmup: int, timeout: float) -> dict:
    path = root / f"{raw['name']}.json"
    path.write_text(json.dumps(raw))
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", "run", str(path)],
        capture_output=True,
        text=True,
        cwd=_REPO,
        timeout=timeout,
    )
    wall = time.perf_counter() - began
    report_path = Path(raw["output_dir"]) / raw["name"] / "train_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    rates = [e["tokens_per_s"] for e in report.get("losses", []) if e.get("tokens_per_s")]
    steady = statistics.median(rates[warmup:]) if len(rates) > warmup else None
    out = {
        "run": raw["name"],
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "steady_tokens_per_s": steady,
        "per_step_tokens_per_s": [round(r) for r in rates],
        "losses": [e["loss"] for e in report.get("losses", [])],
        "train": {k: report.get(k) for k in ("micro_batch_size", "gradient_accumulation_steps", "stored_layers")},
        "world_size": report.get("world_size"),
    }
    if proc.returncode:
        out["log_tail"] = (proc.stdout + proc.stderr)[-4000:]
    print(json.dumps({k: v for k, v in out.items() if k not in ("losses", "log_tail")}), flush=True)
    if proc.returncode:
        print(out["log_tail"], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="logged steps left out of the steady rate")
    ap.add_argument("--root", type=Path, default=Path("/tmp/ray-scaling"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=400)
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    t0 = time.perf_counter()
    model = build_model(args.shape, args.root)
    built = time.perf_counter() - t0
    data = write_data(args.root, rows=max(64, args.steps * 12))
    runs = args.root / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    base = (model, data, runs)
    results = {}
    ray = [sys.executable, "-m", "ray.scripts.scripts"]  # pip --target installs no `ray` command
    subprocess.run(
        [*ray, "start", "--head", "--num-gpus=2", "--include-dashboard=false", "--disable-usage-stats"],
        check=True,
        capture_output=True,
        text=True,
    )
    try:
        for name, raw in (
            (
                "one_gpu",
                _spec(*base, "one-gpu", args.steps, gradient_accumulation_steps=2, stored_layers=0, cuda_graphs=False),
            ),
            ("torchrun_2", _spec(*base, "torchrun-2", args.steps, num_gpus=2)),
            ("ray_2", _spec(*base, "ray-2", args.steps, cluster={"address": "auto", "num_workers": 2})),
            ("one_gpu_defaults", _spec(*base, "one-gpu-defaults", args.steps, gradient_accumulation_steps=2)),
        ):
            results[name] = _run(args.root, raw, args.warmup, args.timeout)
    finally:
        subprocess.run([*ray, "stop", "--force"], capture_output=True, text=True)

    def ratio(a: str, b: str) -> float | None:
        x, y = results[a]["steady_tokens_per_s"], results[b]["steady_tokens_per_s"]
        return round(x / y, 4) if x and y else None

    summary = {
        "scaling_ray": ratio("ray_2", "one_gpu"),
        "scaling_torchrun": ratio("torchrun_2", "one_gpu"),
        "ray_vs_torchrun": ratio("ray_2", "torchrun_2"),
        "ray_vs_one_gpu_defaults": ratio("ray_2", "one_gpu_defaults"),
        "losses_max_abs_diff_ray_torchrun": max(
            (abs(a - b) for a, b in zip(results["ray_2"]["losses"], results["torchrun_2"]["losses"])), default=None
        ),
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    write_json_atomic(
        args.out / f"ray-scaling-{args.shape}.json",
        {
            "command": command_line("benchmarks/ray_scaling.py", sys.argv[1:]),
            "environment": environment("cuda"),
            "build_s": round(built, 1),
            "summary": summary,
            "runs": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
