#!/usr/bin/env python3
"""Where a training step's GPU time goes, per config: kernel time by category, idle time, top kernels.

The speed table says *how fast*; this says *why*. For each config of `runner.py` it runs the same
step as `measure_training` (warm-up first), then profiles a few steps with torch.profiler and reports:
wall time per step, GPU busy time per step (sum of kernel and copy time; the rest of the wall is the
GPU waiting for the host), busy time by category (matmul, attention, slimtune Triton kernels,
bitsandbytes, element-wise, copies), the kernels that take the most time and the host ops that take
the most CPU time. Config `product` profiles the product's own path instead of the hand loop:
attach_lora + packed_sft on chat data (benchmarks/product.py), steps after the warm-up.

    python3 benchmarks/profile_step.py --model 8b --batch 4 --configs hf_gc,ours,product --out "$OUT"
Writes OUT/profile-<model>-b<batch>.json and prints the tables.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import TrainerCallback

from benchmarks.common import (
    MODEL_SHAPES,
    attach_lora,
    build_random_model,
    free_memory,
    quantize_nf4_,
    random_batch,
    reset_lora_,
    trainable_parameters,
    write_json_atomic,
    write_text_atomic,
)
from benchmarks.runner import _prepare, ours_loss

# Substrings of kernel names, checked in order; the first match names the category.
_CATEGORIES = (
    ("copy", ("memcpy", "memset", "Memcpy", "Memset")),
    ("attention", ("flash", "fmha", "attention", "Attention")),
    ("bitsandbytes", ("kDequantize", "kgemm_4bit", "dequantize")),
    ("matmul", ("gemm", "Gemm", "GEMM", "cutlass", "xmma", "nvjet", "cublas", "splitK")),
    (
        "elementwise",
        (
            "at::native",
            "elementwise",
            "reduce",
            "Reduce",
            "softmax",
            "Cat",
            "foreach",
            "multi_tensor",
            "Adam",
            "cudnn::",
        ),
    ),
    ("slimtune triton", ("_kernel",)),  # Triton kernels are named after their function, e.g. _nf4_kernel
)


# CUDA runtime and driver calls that put work on the GPU: one per kernel, memset or copy
_RUNTIME_CALLS = frozenset(
    {
        "cudaLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaMemsetAsync",
        "cudaMemcpyAsync",
    }
)


def _category(name: str) -> str:
    for cat, keys in _CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def _prepare_variant(config: str, model: torch.nn.Module) -> tuple[Callable, dict[str, Any], Callable[[], None]]:
    """runner's configs, plus `ours_nogc` (kernels, no checkpointing), `ours_nokernels` (the reverse) and
    `ours_no_<kernel>` (ours without one kernel, e.g. `ours_no_lora_nf4`)."""
    from slimtune.kernels.apply import KERNEL_NAMES, apply_kernels
    from slimtune.train.step import enable_checkpointing

    if config == "ours_nogc":
        patch = apply_kernels(model, "auto")  # no checkpointed layer: no pass to read
        return ours_loss, {"kernels": patch.modules}, patch.undo
    if config == "ours_nokernels":
        handle = enable_checkpointing(model, "unsloth")
        return ours_loss, {"offloading": handle.offloading}, handle.undo
    if config.startswith("ours_no_"):
        left_out = config.removeprefix("ours_no_")
        if left_out not in KERNEL_NAMES:
            raise ValueError(f"{config}: {left_out!r} is not one of {KERNEL_NAMES}")
        handle = enable_checkpointing(model, "unsloth")
        patch = apply_kernels(model, [k for k in KERNEL_NAMES if k != left_out], checkpoint_pass=handle.layer_pass)

        def undo() -> None:
            patch.undo()
            handle.undo()

        return ours_loss, {"kernels": patch.modules}, undo
    return _prepare(config, model)


def profile_config(model: torch.nn.Module, config: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    """Warm `config` up, then profile `steps` steps; return wall, busy and per-category seconds per step."""
    loss_fn, notes, undo = _prepare_variant(config, model)
    try:
        reset_lora_(model)
        model.train()
        data = random_batch(model.config.vocab_size, batch, seq, "cuda")
        opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-4, fused=True)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model, data)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):  # unprofiled first, in the same process as the profiled steps
            step()
        torch.cuda.synchronize()
        notes = {**notes, "unprofiled": {"step_s": round((time.perf_counter() - t0) / steps, 4)}}
        torch.cuda.reset_peak_memory_stats()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps
        opt.state.clear()
        return summarize(prof, steps, wall, torch.cuda.max_memory_allocated(), config, batch, seq, notes)
    finally:
        undo()
        free_memory("cuda")


def summarize(prof, steps: int, wall: float, peak: int, config: str, batch: int, seq: int, notes: dict) -> dict:
    """Per step: wall, GPU busy (kernel and copy time) and idle, busy by category, top kernels, and the host ops
    that took the most CPU time (where a host-bound step goes)."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += ev.device_time / 1e6 / steps  # us -> s, per step
            k[1] += 1 / steps
    busy = sum(t for t, _ in kernels.values())
    cats: dict[str, float] = defaultdict(float)
    for name, (t, _) in kernels.items():
        cats[_category(name)] += t
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[
        :25
    ]
    launches: dict[str, float] = defaultdict(float)  # each launch, memset and copy by the host ops around it
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name in _RUNTIME_CALLS:
            chain, parent = [ev.name], ev.cpu_parent
            while parent is not None and len(chain) < 4:
                chain.append(parent.name)
                parent = parent.cpu_parent
            launches[" <- ".join(chain)] += 1 / steps
    return {
        "config": config,
        "batch": batch,
        "seq": seq,
        "wall_s": round(wall, 4),
        "busy_s": round(busy, 4),
        "idle_s": round(wall - busy, 4),
        "tokens_per_s": round(batch * seq / wall, 1),
        "peak_allocated_gib": round(peak / 2**30, 2),
        "kernels_per_step": round(sum(c for _, c in kernels.values())),
        "categories_s": {k: round(v, 4) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "s": round(t, 5), "calls": round(c, 1)} for n, (t, c) in top],
        "top_host_ops": [
            {"name": e.key[:160], "self_cpu_s": round(e.self_cpu_time_total / 1e6 / steps, 5), "calls": e.count / steps}
            for e in host
        ],
        "launch_sources": [
            {"chain": k[:300], "calls": round(v, 1)} for k, v in sorted(launches.items(), key=lambda kv: -kv[1])[:60]
        ],
        "notes": notes,
    }


class _StepProfiler(TrainerCallback):
    """A Trainer callback that profiles whole optimizer-step cycles warmup+1 .. warmup+steps of `packed_sft`:
    from one step's start to the next's, so the log line, the callbacks and the next batch's fetch count too.
    With `python_stats`, cProfile records the same window (where the host's time goes, by Python function)."""

    def __init__(self, warmup: int, steps: int, python_stats: bool = False) -> None:
        super().__init__()
        self.warmup, self.steps = warmup, steps
        self.prof: torch.profiler.profile | None = None
        self.python = cProfile.Profile() if python_stats else None
        self.t0: float | None = None
        self.wall = 0.0
        self.peak = 0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.warmup and self.prof is None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.prof = torch.profiler.profile(activities=acts) if self.python is None else None
            if self.prof is not None:
                self.prof.__enter__()
            else:
                self.python.enable()
            self.t0 = time.perf_counter()
        elif state.global_step == self.warmup + self.steps and self.t0 is not None and not self.wall:
            torch.cuda.synchronize()
            self.wall = (time.perf_counter() - self.t0) / self.steps
            self.peak = torch.cuda.max_memory_allocated()
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
            else:
                self.python.disable()


class StepTimes(TrainerCallback):
    """Host timestamps of each step's start and end (no profiler): the median time inside the step (forward,
    backward, clipping, optimizer) and between one step's end and the next's start (log line with its host
    sync, callbacks, the next batch's fetch)."""

    def __init__(self) -> None:
        super().__init__()
        self.begins: list[float] = []
        self.ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.begins.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.ends.append(time.perf_counter())

    def summary(self, warmup: int) -> dict:
        inside = [e - b for b, e in zip(self.begins, self.ends)][warmup:]
        between = [b - e for e, b in zip(self.ends, self.begins[1:])][warmup:]
        cycle = [b2 - b1 for b1, b2 in zip(self.begins, self.begins[1:])][warmup:]
        return {
            "step_s": round(statistics.median(cycle), 4),
            "inside_step_s": round(statistics.median(inside), 4),
            "between_steps_s": round(statistics.median(between), 4),
            "cycles_s": [round(c, 4) for c in cycle],
        }


class _FirstSync(TrainerCallback):
    """Raise at the first host-device synchronization inside step warmup+1 (torch's sync debug mode "error"):
    a sync in the middle of a step makes the host wait for the GPU, so launches stop running ahead."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.warmup = warmup

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.warmup:
            torch.cuda.set_sync_debug_mode("error")

    def on_step_end(self, args, state, control, **kwargs) -> None:
        torch.cuda.set_sync_debug_mode("default")


def first_sync(model_key: str, batch: int, seq: int, warmup: int, scratch: Path) -> str:
    """The traceback of the first synchronizing call inside a product step after warm-up, or a line saying none."""
    from benchmarks.product import prepare_product, train_product

    ps = prepare_product(model_key, batch, seq, warmup + 2, "cuda", scratch)
    try:
        train_product(ps, f"sync-{model_key}-b{batch}", batch, seq, warmup + 2, "cuda", callbacks=[_FirstSync(warmup)])
    except RuntimeError as e:
        torch.cuda.set_sync_debug_mode("default")
        return traceback.format_exc() if "synchroniz" in str(e) else f"failed otherwise: {e}"
    return "no synchronizing call inside the step"


def profile_product(
    model_key: str, batch: int, seq: int, warmup: int, steps: int, scratch: Path, python_stats: bool = False
) -> dict:
    """The product's training path (attach_lora + packed_sft: Trainer, packing, collator, callbacks, kernels)."""
    from benchmarks.product import prepare_product, train_product

    total = warmup + steps + 1  # the window ends where step warmup+steps+1 begins
    ps = prepare_product(model_key, batch, seq, total, "cuda", scratch)
    times = StepTimes()
    name = f"profile-{model_key}-b{batch}"
    train_product(ps, f"{name}-times", batch, seq, total, "cuda", callbacks=[times])  # unprofiled first
    no_gc = StepTimes()  # the same with Python's cyclic garbage collector off: does it cost per step?
    gc.freeze()
    gc.disable()
    try:
        train_product(ps, f"{name}-nogc", batch, seq, total, "cuda", callbacks=[no_gc])
    finally:
        gc.enable()
        gc.unfreeze()
    cb = _StepProfiler(warmup, steps, python_stats)
    # cProfile sees one thread: run backward on this one too (autograd runs it on its device thread)
    torch.autograd.set_multithreading_enabled(not python_stats)
    try:
        report = train_product(ps, name, batch, seq, total, "cuda", callbacks=[cb])
    finally:
        torch.autograd.set_multithreading_enabled(True)
    notes = {
        "kernels": ps.lora.kernels,
        "batching": report.batching,
        "padding_waste": round(report.padding_waste, 4),
        "unprofiled": times.summary(warmup),
        "unprofiled_gc_off": no_gc.summary(warmup),
    }
    if python_stats:  # cProfile instead of torch.profiler: wall per step and the host's Python functions
        out = io.StringIO()
        stats = pstats.Stats(cb.python, stream=out).sort_stats("tottime")
        stats.print_stats(45)
        stats.print_callers(r"\(named_parameters\)|\(parameters\)|\(train\)", 12)
        stats.sort_stats("cumulative").print_stats(70)  # where the host's time goes, by caller
        return {
            "config": "product",
            "batch": batch,
            "seq": seq,
            "wall_s": round(cb.wall, 4),
            "notes": notes,
            "python_cumulative": out.getvalue(),
        }
    return summarize(cb.prof, steps, cb.wall, cb.peak, "product", batch, seq, notes)


def _print(r: dict) -> None:
    print(
        f"\n== {r['config']} b{r['batch']}: wall {r['wall_s']:.4f} s/step, busy {r['busy_s']:.4f}, "
        f"idle {r['idle_s']:.4f}, {r['tokens_per_s']:.0f} tok/s, peak {r['peak_allocated_gib']} GiB"
    )
    print("   " + ", ".join(f"{k} {v:.4f}" for k, v in r["categories_s"].items()))
    print(f"   unprofiled: {r['notes'].get('unprofiled')}")
    if "unprofiled_gc_off" in r["notes"]:
        print(f"   unprofiled, gc off: {r['notes']['unprofiled_gc_off']}")
    print(f"   {r['kernels_per_step']} kernels per step; top kernels:")
    for k in r["top_kernels"][:18]:
        print(f"   {k['s']:.5f} s  x{k['calls']:<6} {k['name'][:110]}")
    print("   host ops by self CPU time per step:")
    for k in r["top_host_ops"][:18]:
        print(f"   {k['self_cpu_s']:.5f} s  x{k['calls']:<8.1f} {k['name'][:110]}")
    print("   launches, memsets and copies per step, by the host ops that made them:")
    for k in r["launch_sources"][:40]:
        print(f"   x{k['calls']:<7.1f} {k['chain'][:160]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", choices=[k for k in MODEL_SHAPES if k != "tiny"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--configs", default="hf_gc,ours")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--python-stats", action="store_true", help="product: cProfile the steps instead")
    ap.add_argument("--first-sync", action="store_true", help="product: print the first host sync inside a step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("profiling needs a CUDA GPU")
    configs = args.configs.split(",")
    if args.first_sync:
        if configs != ["product"]:
            ap.error("--first-sync looks at the product's step: use it with --configs product alone")
        with tempfile.TemporaryDirectory() as scratch:
            found = first_sync(args.model, args.batch, args.seq, args.warmup, Path(scratch))
        print(found)
        args.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out / f"first-sync-{args.model}-b{args.batch}.txt", found + "\n")
        return 0
    harness = [c for c in configs if c != "product"]
    results = []
    if harness:
        model = attach_lora(_quantized(args.model))
        for config in harness:
            r = profile_config(model, config, args.batch, args.seq, args.warmup, args.steps)
            _print(r)
            results.append(r)
        del model
        free_memory("cuda")
    if "product" in configs:  # last: it owns its own model (the product attaches LoRA its way)
        with tempfile.TemporaryDirectory() as scratch:
            r = profile_product(
                args.model, args.batch, args.seq, args.warmup, args.steps, Path(scratch), args.python_stats
            )
        if args.python_stats:
            print(r["python_cumulative"], f"unprofiled: {r['notes']['unprofiled']}", sep="\n")
            print(f"unprofiled, gc off: {r['notes']['unprofiled_gc_off']}")
        else:
            _print(r)
        results.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        args.out / f"profile-{args.model}-b{args.batch}.json",
        {"gpu": torch.cuda.get_device_name(), "model": args.model, "results": results},
    )
    return 0


def _quantized(key: str) -> torch.nn.Module:
    model = build_random_model(MODEL_SHAPES[key], "cuda")
    quantize_nf4_(model)
    return model


if __name__ == "__main__":
    sys.exit(main())
