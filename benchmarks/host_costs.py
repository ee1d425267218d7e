#!/usr/bin/env python3
"""Host time per decoder layer, slimtune's kernels vs Unsloth's, and where slimtune's goes.

The 1B and batch-1 cells are bound by the host: at 1B batch 1 the GPU is busy 0.046 s of a ~0.2 s product
step (profile_step.py). What decides them is how long Python and the launchers take per layer, which a
profiler inflates. Here each stack trains the same shape at a short sequence (`--seq`, default 256), where
the GPU finishes each kernel before the host has launched the next, so the wall clock of a step is its host
time. Two depths (`--layers`, default 2,6) give the cost of one layer as the slope, free of the embedding,
the loss and the optimizer, and what is left at zero layers as the intercept (`fixed_us`):

- `ours`: `enable_checkpointing(model, "unsloth")` + `apply_kernels(model, "auto")`, as `attach_lora` does;
- `unsloth`: Unsloth's `FastLanguageModel` on the same random weights saved to disk, "unsloth" checkpointing.

Each stack runs in its own process (Unsloth patches transformers on import). A step is a forward with the
loss, a backward and `float(loss)`; the optimizer is left out (the same fused AdamW in both). Each stack's step is
also counted under torch.profiler: GPU launches and aten ops per layer (the slope again), which no noisy
clock blurs. `ours` also times its parts on one layer: a projection through peft's module and through the
LoRA Function alone, the NF4 dequantization whole and its Triton launch alone, an RMSNorm, a layer's forward
without grad, a layer's forward and backward with grad, and a plain `add_` as the floor.

    python3 benchmarks/host_costs.py --model 1b --out "$OUT"
Writes OUT/host-costs-<model>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL_SHAPES, ModelShape, environment, write_json_atomic

STACKS = ("ours", "unsloth")


def _host_us(fn: Callable[[], Any], reps: int) -> float:
    """Median host microseconds of one `fn()`, the GPU drained before each call so its queue never throttles."""
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 1)


def _shape(model_key: str, layers: int) -> ModelShape:
    shape = MODEL_SHAPES[model_key]
    return ModelShape(shape.key, shape.name, shape.family, {**shape.config, "num_hidden_layers": layers})


def _ours(shape: ModelShape):
    from benchmarks.common import attach_lora, build_random_model, quantize_nf4_
    from slimtune.kernels.apply import apply_kernels
    from slimtune.train.step import enable_checkpointing

    model = build_random_model(shape, "cuda")
    quantize_nf4_(model)
    model = attach_lora(model)
    handle = enable_checkpointing(model, "unsloth")
    patch = apply_kernels(model, "auto", checkpoint_pass=handle.layer_pass)
    model.train()
    return model, (handle, patch)


def _unsloth(shape: ModelShape, scratch: Path):
    from benchmarks.common import build_random_model, save_word_tokenizer
    from benchmarks.runner import import_unsloth, load_unsloth_lora

    fast = import_unsloth()
    import torch

    folder = scratch / f"unsloth-{shape.config['num_hidden_layers']}"
    model = build_random_model(shape, "cuda")
    model.save_pretrained(str(folder))
    save_word_tokenizer(folder)
    del model
    torch.cuda.empty_cache()
    model, _ = load_unsloth_lora(fast, folder, shape.key, 4096)
    fast.for_training(model)
    shutil.rmtree(folder, ignore_errors=True)
    return model, None


def _step(model, seq: int) -> Callable[[], None]:
    """One training step without the optimizer: forward with the loss, backward, read the loss."""
    from benchmarks.common import random_batch

    batch = random_batch(model.config.vocab_size, 1, seq, "cuda")
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        float(loss)
        for p in params:
            p.grad = None

    for _ in range(5):
        step()
    return step


def _counts(step: Callable[[], None]) -> dict[str, int]:
    """What one step asks of the host, counted (no clock, so no noise): GPU launches (kernels, memsets and
    copies) and aten ops dispatched, nested ones included."""
    import torch

    from benchmarks.profile_step import _RUNTIME_CALLS  # here, not at the top: Unsloth must import first

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
    names = [e.name for e in prof.events()]
    return {
        "launches": sum(n in _RUNTIME_CALLS for n in names),
        "aten_ops": sum(n.startswith("aten::") for n in names),
    }


def _parts_us(model, seq: int, reps: int) -> dict[str, float]:
    """Host microseconds of the pieces of one of our decoder layers."""
    import torch

    from slimtune.kernels.lora_linear import lora_nf4_linear
    from slimtune.kernels.nf4 import dequantize_nf4_scratch
    from slimtune.kernels.rms_norm import rms_norm

    base = model.get_base_model()
    layer = base.model.layers[0]
    hidden = torch.randn(1, seq, base.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    position_ids = torch.arange(seq, device="cuda").unsqueeze(0)
    rope = base.model.rotary_emb(hidden, position_ids)
    proj = layer.self_attn.q_proj
    w = proj.base_layer.weight
    a, b = proj.lora_A["default"].weight, proj.lora_B["default"].weight
    small = torch.zeros(16, device="cuda")
    out = {}
    with torch.no_grad():
        out["aten_add_"] = _host_us(lambda: small.add_(1), reps)
        out["rms_norm"] = _host_us(lambda: rms_norm(hidden, layer.input_layernorm.weight, 1e-5), reps)
        out["nf4_dequant"] = _host_us(lambda: dequantize_nf4_scratch(w, w.quant_state, torch.bfloat16), reps)
        out["nf4_triton_launch_only"] = _host_us(_nf4_launch_only(w), reps)
        out["lora_fn_nograd"] = _host_us(lambda: lora_nf4_linear(hidden, w, w.quant_state, None, a, b, 1.0), reps)
        out["peft_module_nograd"] = _host_us(lambda: proj(hidden), reps)
        out["layer_nograd"] = _host_us(lambda: layer(hidden, position_embeddings=rope), reps)
    x = hidden.detach().requires_grad_()

    def fwd_bwd() -> None:
        y = layer(x, position_embeddings=rope)
        (y[0] if isinstance(y, tuple) else y).sum().backward()

    out["layer_grad_fwd_bwd"] = _host_us(fwd_bwd, reps)
    return out


def _nf4_launch_only(w) -> Callable[[], None]:
    """The NF4 kernel's launch through Triton's `JITFunction.run` with its arguments prepared once: the part of
    `nf4_dequant` that is Triton's, the rest being slimtune's Python around it."""
    import torch
    import triton

    from slimtune.kernels.nf4 import _BYTES_PER_PROGRAM, _nf4_kernel

    qs, s2 = w.quant_state, w.quant_state.state2
    out = torch.empty(tuple(qs.shape), dtype=torch.bfloat16, device="cuda")
    args = (
        w.reshape(-1).view(torch.uint8),
        qs.absmax,
        qs.code.float(),
        out.view(torch.int16),
        out.numel(),
        s2.code.float(),
        s2.absmax,
        torch.as_tensor(qs.offset, dtype=torch.float32, device="cuda"),
    )
    opts = dict(BLOCKSIZE=qs.blocksize, NESTED=True, BLOCK2=s2.blocksize, BF16_BITS=True, BLOCK=_BYTES_PER_PROGRAM)
    grid = (triton.cdiv(out.numel(), 2 * _BYTES_PER_PROGRAM),)
    return lambda: _nf4_kernel[grid](*args, **opts, num_warps=4, enable_fp_fusion=False)


def worker(stack: str, model_key: str, layers: list[int], seq: int, reps: int) -> dict[str, Any]:
    import torch

    row: dict[str, Any] = {"stack": stack, "model": model_key, "seq": seq, "step_us": {}, "counts": {}}
    with tempfile.TemporaryDirectory(prefix="host-costs-") as scratch:
        for n in layers:
            shape = _shape(model_key, n)
            model, keep = _ours(shape) if stack == "ours" else _unsloth(shape, Path(scratch))
            step = _step(model, seq)
            row["step_us"][n] = _host_us(step, reps)
            row["counts"][n] = _counts(step)
            del step
            if stack == "ours" and n == layers[0]:
                row["parts_us"] = _parts_us(model, seq, reps)
            del model, keep
            torch.cuda.empty_cache()
    lo, hi = layers[0], layers[-1]
    row["layer_us"] = round((row["step_us"][hi] - row["step_us"][lo]) / (hi - lo), 1)
    row["fixed_us"] = round(row["step_us"][lo] - lo * row["layer_us"], 1)  # embedding, loss, the step's setup
    row["layer_counts"] = {k: (row["counts"][hi][k] - row["counts"][lo][k]) / (hi - lo) for k in row["counts"][lo]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--layers", default="2,6", help="two depths; the per-layer cost is the slope between them")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--worker", choices=STACKS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    layers = sorted(int(n) for n in args.layers.split(","))
    if args.worker:
        print("ROW " + json.dumps(worker(args.worker, args.model, layers, args.seq, args.reps)), flush=True)
        return 0
    rows = []
    for stack in args.stacks.split(","):
        cmd = [sys.executable, __file__, "--worker", stack, "--model", args.model, "--layers", args.layers]
        cmd += ["--seq", str(args.seq), "--reps", str(args.reps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode or not found:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
            rows.append({"stack": stack, "status": "error", "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        rows.append({**json.loads(found[-1]), "status": "ok"})
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['stack']:>8}: {r['error']}")
            continue
        steps = ", ".join(f"{n} layers {us / 1e3:.2f} ms" for n, us in r["step_us"].items())
        per_layer, fixed = r["layer_us"] / 1e3, r["fixed_us"] / 1e3
        print(f"{r['stack']:>8}: {per_layer:.2f} ms per layer, {fixed:.2f} ms outside the layers (step: {steps})")
        counts = ", ".join(f"{v:g} {k}" for k, v in r["layer_counts"].items())
        print(f"{'':>10}per layer and step: {counts}")
        for part, us in r.get("parts_us", {}).items():
            print(f"{'':>10}{part:>22}: {us:8.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host-costs-{args.model}.json"
    write_json_atomic(path, {"command": " ".join(sys.argv), "environment": environment("cuda"), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
