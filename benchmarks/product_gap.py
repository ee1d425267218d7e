#!/usr/bin/env python3
"""Where the product's step loses to the hand loop: both on one model, in one process, rounds interleaved.

Separate processes on the device's H100s put the same hand-loop step at 0.159 s in one call and 0.251 s in
another (benchmarks/README.md), so "product ÷ hand loop" from two processes mixes the machine's noise into
the gap. Here one model, prepared as `attach_lora` prepares it (kernels, "unsloth" checkpointing), trains
in turn through:

- `harness`: the performance table's `ours` row as `runner.py` measures it, on a second model built as `runner.py`
  builds it (bf16 autocast, fused AdamW, each step bracketed by synchronizes): the hand loop of the table,
  in the product's process;
- `hand`: a plain loop on the product's model (random unpacked rows, SDPA, fused AdamW, `zero_grad(set_to_none)`);
- `hand_varlen`: the same rows split into packed examples (restarting position ids), so attention takes the
  product's varlen path;
- `hand_trainer_walks`: `hand_varlen` plus what Trainer does around each step: `model.train()`, gradient
  clipping over `model.parameters()` and `model.zero_grad()`;
- `product`: `packed_sft` itself (Trainer, collator, callbacks), step cycles timed by a callback.

It also times, on the same model, the host cost of Trainer's walks alone: the class's and, as `packed_sft`
runs them, from `slimtune.train.step.walks.walks_from_lists` (`walks_host_ms`).

Each is timed over whole step cycles (host clock, the GPU drained at the end); rounds alternate so a slow
spell of the machine hits every variant. Rows give the median cycle per variant over all rounds.

    python3 benchmarks/product_gap.py --model 1b --batch 1,4 --rounds 3 --out "$OUT"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import MODEL_SHAPES, random_batch, write_json_atomic
from benchmarks.product import prepare_product, train_product
from benchmarks.profile_step import StepTimes

VARIANTS = ("harness", "hand", "hand_varlen", "hand_trainer_walks", "product")
_EXAMPLE_TOKENS = 512  # packed example length for the hand loop's varlen variants


def _hand_loop(model: torch.nn.Module, batch: dict, steps: int, walks: bool) -> list[float]:
    """Cycle seconds of `steps` optimizer steps of the harness's loop, optionally with Trainer's walks."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    times = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        if walks:
            model.train()
        loss = model(**batch).loss
        loss.backward()
        if walks:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if walks:
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        float(loss)  # Trainer's log line reads the loss every step (logging_steps: 1): one sync per step
        now = time.perf_counter()
        times.append(now - t0)
        t0 = now
    return times


def _harness(model_key: str, batch: dict):
    """The second model, prepared as `runner.py`'s `ours` row, and a function timing n of its steps."""
    from benchmarks.common import attach_lora, build_random_model, quantize_nf4_, run_steps, trainable_parameters
    from benchmarks.runner import _prepare

    model = build_random_model(MODEL_SHAPES[model_key], "cuda")
    quantize_nf4_(model)
    model = attach_lora(model)
    loss_fn, _, _ = _prepare("ours", model)
    model.train()
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-4, fused=True)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, lambda n: run_steps(step, 0, n, "cuda")[0]


def walk_ms(model: torch.nn.Module, reps: int = 50) -> dict[str, float]:
    """Host milliseconds of one step's Trainer walks (`train()`, `parameters()` for clipping, `zero_grad()`),
    median of `reps`: as the model's class does them, and from `walks_from_lists` (what `packed_sft` uses)."""
    from slimtune.train.step.walks import walks_from_lists

    def once() -> float:
        t0 = time.perf_counter()
        model.train()
        for _ in model.parameters():
            pass
        model.zero_grad()
        return time.perf_counter() - t0

    out = {"class": statistics.median(once() for _ in range(reps)) * 1e3}
    with walks_from_lists(model) as listed:
        if not listed:
            raise RuntimeError("walks_from_lists refused this model")
        out["lists"] = statistics.median(once() for _ in range(reps)) * 1e3
    return {k: round(v, 3) for k, v in out.items()}


def _packed(unpacked: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The rows as the product's collator hands them to varlen attention: one flattened row of examples."""
    ids = unpacked["input_ids"].reshape(1, -1)
    total = ids.shape[1]
    cu = torch.arange(0, total + 1, _EXAMPLE_TOKENS, dtype=torch.int32, device=ids.device)
    return {
        "input_ids": ids,
        "labels": ids,
        "position_ids": (torch.arange(total, device=ids.device) % _EXAMPLE_TOKENS).unsqueeze(0),
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": _EXAMPLE_TOKENS,
        "max_length_k": _EXAMPLE_TOKENS,
    }


def measure(model_key: str, batches: list[int], seq: int, warmup: int, steps: int, rounds: int, scratch: Path):
    from slimtune.train.step.attention import prefer_varlen

    ps = prepare_product(model_key, max(batches), seq, (warmup + steps + 1) * rounds, "cuda", scratch)
    from slimtune.core import registry

    model = registry.get(ps.handle)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rows: list[dict[str, Any]] = []
    threads: set[str] = set()
    walks = walk_ms(model)
    print(f"{model_key} Trainer walks per step: {walks['class']:.2f} ms by the class, {walks['lists']:.2f} ms listed")
    for b in batches:
        cycles: dict[str, list[float]] = {v: [] for v in VARIANTS}
        unpacked = random_batch(base.config.vocab_size, b, seq, "cuda")
        packed = _packed(unpacked)
        harness_model, harness = _harness(model_key, unpacked)
        for r in range(rounds):
            for variant in VARIANTS:
                if variant == "harness":
                    cycles[variant] += harness(warmup + steps)[warmup:]
                    continue
                if variant == "product":
                    times = StepTimes()
                    train_product(ps, f"gap-{model_key}-b{b}-r{r}", b, seq, warmup + steps + 1, "cuda", [times])
                    cycles[variant] += times.summary(warmup)["cycles_s"]
                    threads |= {t.name for t in threading.enumerate()}
                    continue
                attn = base.config._attn_implementation
                base.config._attn_implementation = "sdpa"  # as the harness; packed_sft may have left varlen on
                if variant != "hand" and not prefer_varlen(base, torch.device("cuda")):
                    raise RuntimeError("this GPU/torch cannot run the varlen path the product uses")
                try:
                    data = unpacked if variant == "hand" else packed
                    walks = variant == "hand_trainer_walks"
                    cycles[variant] += _hand_loop(model, data, warmup + steps, walks)[warmup:]
                finally:
                    base.config._attn_implementation = attn
        del harness_model, harness
        torch.cuda.empty_cache()
        hand = statistics.median(cycles["hand"])
        for variant in VARIANTS:
            med = statistics.median(cycles[variant])
            rows.append(
                {
                    "model": model_key,
                    "batch": b,
                    "seq": seq,
                    "variant": variant,
                    "cycle_s_median": round(med, 4),
                    "cycle_s_min": round(min(cycles[variant]), 4),
                    "cycle_s_max": round(max(cycles[variant]), 4),
                    "cycles": len(cycles[variant]),
                    "vs_hand": round(med / hand, 3),
                }
            )
            print(f"{model_key} b{b} {variant:>20}: {med:.4f} s/step ({med / hand:.3f}x hand)", flush=True)
    return rows, sorted(threads), walks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--batch", default="1,4", help="comma-separated micro-batch sizes")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tag", default="", help="suffix of the output file name, e.g. the code version")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("product_gap needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        rows, threads, walks = measure(
            args.model, batches, args.seq, args.warmup, args.steps, args.rounds, Path(scratch)
        )
    out = args.out / f"product-gap-{args.model}{'-' + args.tag if args.tag else ''}.json"
    meta = {"gpu": torch.cuda.get_device_name(), "args": {k: str(v) for k, v in vars(args).items()}}
    write_json_atomic(out, meta | {"rows": rows, "threads_during_product": threads, "walks_host_ms": walks})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
