"""GPU memory calibration: the real product stages on real model shapes, estimate vs measured, one JSON.

Two modes, both through the device tool (see benchmarks/README.md, "Memory calibration"):

- grid (default): per (model, kernels) one worker process builds nothing but runs the plain task functions
  `load_4bit` -> `attach_lora` -> `packed_sft` (2 optimizer steps per cell) over micro-batch x sequence x
  checkpointing cells, each under the product's own `guarded(...)` sampler. Every cell records the allocator
  peak, the reserved peak, device-wide used memory (cudaMemGetInfo / NVML, CUDA context and library
  workspaces included), host RSS and anonymous RSS.
- e2e (`--e2e 6:1:unsloth,16:4:unsloth`): `slimtune run SPEC` as a user runs it, preflight on, under
  `guard.gpu_memory_fraction = BUDGET GiB / device total`; the per-stage guard records come back. Each item is
  BUDGET_GIB:MICRO_BATCH:CHECKPOINTING, then optionally `merge` (f16 GGUF), `stored=N` (`train.stored_layers`;
  auto when not given) and `r=N` (LoRA rank and alpha; 16 when not given).

The models are random bf16 weights saved as safetensors (5 GB shards, as on the Hub), built in their own
process so the measuring processes start with an empty GPU. Results are appended after every cell, so a
worker killed at the time budget still leaves what it measured. The CPU test
(tests/test_memory_calibration.py) holds `slimtune.memory.estimate` to the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODEL_SHAPES

GiB = 1024**3
CHECKPOINTING = ("unsloth", True, False)


def _config(key: str) -> dict:
    shape = MODEL_SHAPES[key]
    return {"model_type": shape.family, **shape.config}


def build_model(key: str, root: Path, device: str = "cuda") -> Path:
    """Random bf16 weights on the GPU, saved as 5 GB safetensors shards with the tiny tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from slimtune.models.tiny import build_tokenizer

    out = root / f"model-{key}"
    if (out / "config.json").is_file():
        return out
    tok = build_tokenizer()
    cfg = dict(_config(key))
    model_type = cfg.pop("model_type")
    cfg["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(out, max_shard_size="5GB")
    tok.save_pretrained(out)
    return out


def write_data(root: Path) -> Path:
    """Plain text rows: enough tokens for 2 steps of 4 x 8192 packed tokens."""
    path = root / "calib.jsonl"
    if path.is_file():
        return path
    rng = random.Random(0)
    words = "the model learns from packed rows of text without padding between examples memory budget".split()
    with path.open("w") as f:
        for _ in range(64):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(3000))}) + "\n")
    return path


def _base_spec(model_dir: Path, data: Path, runs: Path, name: str, device: str = "cuda") -> dict:
    return {
        "name": name,
        "output_dir": str(runs),
        "model": {"name_or_path": str(model_dir), "device": device},
        "lora": {"r": 16, "alpha": 16, "dropout": 0.0, "gradient_checkpointing": "unsloth"},
        "data": {"path": str(data), "format": "text", "max_seq_length": 2048, "eval_fraction": 0.0},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 2, "save_steps": 1000},
        "merge": {"enabled": False},
        "export": {"gguf": []},
    }


def _record(rec) -> dict:
    return {
        "peak_allocated": rec.peak_gpu_allocated,
        "peak_reserved": rec.peak_gpu_reserved,
        "peak_device_used": rec.peak_device_used,
        "peak_host_rss": rec.peak_host_rss,
        "peak_host_anon": rec.peak_host_anon,
        "seconds": round(rec.seconds, 2),
        "outcome": rec.outcome,
    }


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def worker(key: str, kernels: str, cells: list[dict], root: Path, results: Path, device: str = "cuda") -> None:
    """Load once, attach LoRA once, then train each cell (2 steps) under the product's guard."""
    from slimtune.core.device import prefer_expandable_segments

    prefer_expandable_segments()  # what resolve_device does in the product, before this worker touches CUDA
    import torch

    from slimtune.core import registry
    from slimtune.memory import estimate_train, guarded
    from slimtune.memory.errors import MemoryPressure
    from slimtune.spec.schema import parse_spec
    from slimtune.tasks.attach_lora import attach_lora
    from slimtune.tasks.load_4bit import load_4bit
    from slimtune.tasks.packed_sft import packed_sft, prepare_data
    from slimtune.train.step.attention import varlen_expected

    model_dir, data = root / f"model-{key}", root / "calib.jsonl"
    base = _base_spec(model_dir, data, root / "runs", f"{key}-{kernels}", device)
    base["train"]["kernels"] = kernels
    spec = parse_spec(base)
    cuda = device == "cuda"
    total = torch.cuda.mem_get_info()[1] if cuda else 1 << 40
    name = torch.cuda.get_device_name() if cuda else "cpu"
    common = {"model": key, "config": _config(key), "kernels": kernels, "device": name, "total": total}
    common["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    with guarded("load_4bit", estimate=None, device=device) as rec:
        loaded = load_4bit(spec)
    _append(results, {**common, "stage": "load_4bit", **_record(rec)})
    lora = attach_lora(spec, loaded.handle)
    examples: dict[int, str] = {}
    for i, cell in enumerate(cells):
        mb, seq, ckpt = cell["micro_batch"], cell["seq_len"], cell["checkpointing"]
        row = {**common, "stage": "packed_sft", **cell, "applied_kernels": sorted(lora.kernels)}
        est = estimate_train(
            _config(key),
            micro_batch=mb,
            seq_len=seq,
            lora_r=16,
            target_modules="all-linear",
            checkpointing=ckpt,
            kernels=sorted(lora.kernels),  # without them full logits are counted: 1B at 4 x 8192 was skipped
            varlen_attention=varlen_expected(_config(key), device, spec.data.packing),
        )
        if est.gpu_bytes > 1.3 * total:  # certain to run out of a whole H100: not worth the minute
            _append(results, {**row, "outcome": "skipped (estimate over 1.3 x device)"})
            continue
        raw = {**base, "name": f"{key}-{kernels}-{i}"}
        raw["lora"] = {**raw["lora"], "gradient_checkpointing": ckpt}
        raw["data"] = {**raw["data"], "max_seq_length": seq}
        raw["train"] = {**raw["train"], "micro_batch_size": mb}
        cell_spec = parse_spec(raw)
        if seq not in examples:
            examples[seq] = prepare_data(cell_spec, str(model_dir))
        try:
            with guarded("packed_sft", estimate=None, device=device) as rec:
                report = packed_sft(
                    cell_spec,
                    lora.handle,
                    lora.checkpointing_handle,
                    examples[seq],
                    micro_batch_size=mb,
                    gradient_accumulation_steps=1,
                    gradient_checkpointing=ckpt,
                )
            row.update(steps=report.steps, tokens_per_s=round(report.tokens_per_s), batching=report.batching)
            # "N captured, M replays" where the layers' backward ran as CUDA graphs (train.cuda_graphs, on by default)
            row["cuda_graphs"] = report.cuda_graphs
            # Where the input table is after training: host_embedding puts it in host memory at attach time.
            row["input_embeddings_device"] = str(registry.get(lora.handle).get_input_embeddings().weight.device)
            if cuda:
                segments = torch.cuda.memory._snapshot()["segments"]
                row["expandable_segments"] = any(s.get("is_expandable") for s in segments)
        except MemoryPressure:
            pass
        _append(results, {**row, **_record(rec)})
        print(
            json.dumps({k: row.get(k) for k in ("model", "kernels", "micro_batch", "seq_len", "checkpointing")}),
            _record(rec),
            flush=True,
        )


def grid_cells(key: str, kernels: str) -> list[dict]:
    """The cells of one worker, smallest first; `none` kernels only at 2048 (full logits dominate)."""
    seqs = (2048, 8192) if kernels == "auto" else (2048,)
    ckpts = CHECKPOINTING if kernels == "auto" else ("unsloth", True)
    cells = [{"micro_batch": mb, "seq_len": seq, "checkpointing": ck} for seq in seqs for mb in (1, 4) for ck in ckpts]
    return sorted(cells, key=lambda c: (c["micro_batch"] * c["seq_len"], str(c["checkpointing"])))


def _e2e(
    root: Path,
    budget_gib: float,
    mb: int | str,
    ckpt: str,
    merge: bool,
    out: Path,
    timeout: float,
    steps: int = 3,
    stored: int | str = "auto",
    rank: int = 16,
) -> dict:
    """`slimtune run` on the 8B shape under a budget, preflight on; the guard records per stage."""
    import torch

    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_initialized() else _device_total()
    name = (
        f"e2e-8b-{budget_gib:g}gib-mb{mb}"
        + ("-merge" if merge else "")
        + ("" if stored == "auto" else f"-stored{stored}")
        + ("" if rank == 16 else f"-r{rank}")
    )
    raw = _base_spec(root / "model-8b", root / "calib.jsonl", root / "runs", name)
    raw["lora"].update(gradient_checkpointing=ckpt, r=rank, alpha=rank)
    raw["train"].update(micro_batch_size=mb, max_steps=steps, stored_layers=stored)
    raw["merge"] = {"enabled": merge}
    raw["export"] = {"gguf": ["f16"] if merge else [], "verify": False}
    raw["guard"] = {"gpu_memory_fraction": round(budget_gib * GiB / total, 4), "preflight": True}
    spec_path = root / f"{name}.json"
    spec_path.write_text(json.dumps(raw))
    t0 = time.time()
    proc, device_peak = _run_sampled([sys.executable, "-m", "slimtune.cli.main", "run", str(spec_path)], root, timeout)
    run_dir = root / "runs" / name
    log_lines = (proc.stdout + proc.stderr).splitlines()
    stages = {}
    for f in sorted((run_dir / "memory").glob("*.json")):
        stages[f.stem] = json.loads(f.read_text())
    report = run_dir / "train_report.json"
    train = json.loads(report.read_text()) if report.is_file() else {}
    (out / f"{name}.log").write_text(proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-40000:])
    gguf = {str(p.relative_to(run_dir)): p.stat().st_size for p in run_dir.rglob("*.gguf")}
    shutil.rmtree(run_dir, ignore_errors=True)  # a merged 8B and its GGUF are 30 GB: the next run needs the disk
    return {
        "run": name,
        "budget_gib": budget_gib,
        "fraction": raw["guard"]["gpu_memory_fraction"],
        "micro_batch": mb,
        "checkpointing": ckpt,
        "rc": proc.returncode,
        "seconds": round(time.time() - t0, 1),
        # nvidia-smi every 0.5 s while the run lived, less the idle card: what the card had to hold
        "device_peak_gib": round(device_peak / GiB, 3) if device_peak is not None else None,
        "train": {
            k: train.get(k)
            for k in ("micro_batch_size", "gradient_accumulation_steps", "steps", "batching", "stored_layers")
        },
        "stages": stages,
        # each logged step's tokens/s, and whether the layers' backward ran as CUDA graphs
        "tok_s": [int(m) for m in re.findall(r"tok/s (\d+)", proc.stdout + proc.stderr)],
        "cuda_graphs": next((ln.split(" - ")[-1] for ln in log_lines if "CUDA graphs" in ln), None),
        "stored_layers": next((ln.split(" - ")[-1] for ln in log_lines if "stored layers auto" in ln), None),
        "lm_head": next((ln.split(" - ")[-1] for ln in log_lines if "lm_head in pinned host memory" in ln), None),
        "lora_r": rank,
        "gguf_files": gguf,  # what the export wrote (bytes), before the run folder was removed
        "last_line": (proc.stderr.strip().splitlines() or [""])[-1] if proc.returncode else proc.stdout.strip()[-200:],
    }


def _run_sampled(cmd: list[str], root: Path, timeout: float) -> tuple[subprocess.CompletedProcess, int | None]:
    """Run `cmd` from the repository root, sampling the card's used memory (nvidia-smi, every 0.5 s) from
    outside the process; returns its result and the peak above the card's used memory before it started."""
    idle = _device_used()
    logs = [root / "run.stdout", root / "run.stderr"]
    with logs[0].open("w") as out, logs[1].open("w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=Path(__file__).resolve().parent.parent)
        deadline, peak = time.time() + timeout, None
        while proc.poll() is None:
            if time.time() > deadline:
                proc.kill()
                raise subprocess.TimeoutExpired(cmd, timeout, *(p.read_text() for p in logs))
            used = _device_used()
            if used is not None and idle is not None:
                peak = max(peak or 0, used - idle)
            time.sleep(0.5)
    stdout, stderr = (p.read_text() for p in logs)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), peak


def _device_total() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return int(out.stdout.split()[0]) * 1024**2


def _device_used() -> int | None:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return int(out.stdout.split()[0]) * 1024**2 if out.returncode == 0 else None


def _worker_cmd(kind: str, key: str, root: Path, out: Path, device: str, *extra: str) -> list[str]:
    """This script as a worker process (a fresh process per model: it starts with an empty GPU)."""
    return [sys.executable, __file__, "--worker", kind, "--models", key, "--root", str(root), "--out", str(out),
            "--device", device, *extra]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="8b")
    p.add_argument("--kernels", default="auto")
    p.add_argument(
        "--e2e", default="", help="BUDGET_GIB:MICRO_BATCH:CHECKPOINTING[:merge][:stored=N],... `slimtune run`s"
    )
    p.add_argument("--e2e-steps", type=int, default=3, help="optimizer steps of each e2e run")
    p.add_argument("--root", default="/tmp/calib")
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--device", default="cuda", help="cpu: a harness check with --models tiny")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    root, out = Path(args.root), Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "calibration.jsonl"
    if args.worker == "build":
        build_model(args.models, root, args.device)
        return 0
    if args.worker == "grid":
        cells = grid_cells(args.models, args.kernels)
        worker(args.models, args.kernels, cells[: 2 if args.device == "cpu" else None], root, results, args.device)
        return 0
    deadline = time.time() + args.budget_s
    write_data(root)
    idle = _device_used() if args.device == "cuda" else None
    for key in args.models.split(","):
        t0 = time.time()
        subprocess.run(
            _worker_cmd("build", key, root, out, args.device),
            check=True,
            timeout=max(deadline - time.time(), 1),
        )
        print(f"built {key} in {time.time() - t0:.0f} s", flush=True)
        if args.e2e:
            continue
        for kernels in args.kernels.split(","):
            left = deadline - time.time()
            if left < 60:
                _append(results, {"model": key, "kernels": kernels, "outcome": "not run (time budget)"})
                continue
            try:
                cmd = _worker_cmd("grid", key, root, out, args.device, "--kernels", kernels)
                subprocess.run(cmd, timeout=left - 20)
            except subprocess.TimeoutExpired:
                _append(results, {"model": key, "kernels": kernels, "outcome": "worker stopped at the time budget"})
    e2e = []
    for item in filter(None, args.e2e.split(",")):
        budget, mb, ckpt, *flags = item.split(":")
        stored = next((f.removeprefix("stored=") for f in flags if f.startswith("stored=")), "auto")
        rank = int(next((f.removeprefix("r=") for f in flags if f.startswith("r=")), 16))
        left = deadline - time.time()
        if left < 60:
            e2e.append({"run": item, "outcome": "not run (time budget)"})
            continue
        try:
            size = mb if mb == "auto" else int(mb)
            stored_n = stored if stored == "auto" else int(stored)
            merge = "merge" in flags
            e2e.append(_e2e(root, float(budget), size, ckpt, merge, out, left - 15, args.e2e_steps, stored_n, rank))
        except subprocess.TimeoutExpired as exc:
            e2e.append({"run": item, "outcome": "stopped at the time budget"})
            log = [x.decode() if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr)]
            (out / f"timeout-{len(e2e)}.log").write_text(log[0][-20000:] + "\n--- stderr ---\n" + log[1][-40000:])
        (out / "e2e.json").write_text(json.dumps(e2e, indent=2, default=str))
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    (out / "memory-calibration.json").write_text(
        json.dumps({"idle_device_used": idle, "rows": rows, "e2e": e2e}, indent=2, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
