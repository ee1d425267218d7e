#!/usr/bin/env python3
"""What is allocated at the product's GPU memory peak, and which line allocated it.

The speed table gives one number per cell, the allocator's high-water mark; this says what it is made of. It
trains the product's path (benchmarks/product.py: attach_lora + packed_sft) with the allocator's history on,
replays that history to the moment of the highest allocated bytes and groups the blocks alive then by the
innermost slimtune line that allocated them (else the innermost line of any file). Blocks allocated before
the history began (weights, adapters) are one group. Each optimizer step begins with a marker allocation of
an odd size, so the peak is also reported per step: the capture of CUDA graphs is step 2, replays after.

    python3 benchmarks/peak_breakdown.py --model 1b --batch 1 --cuda-graphs on,off --out "$OUT"
Writes OUT/peak-<model>-b<batch>-<graphs|eager>.json and prints the groups.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import TrainerCallback

from benchmarks.common import MODEL_SHAPES, write_json_atomic

_MARK = 2411 * 512  # the step marker's bytes (1.18 MiB, whole 512 B blocks): a size nothing else makes
_GIB = 1 << 30


class _StepMarker(TrainerCallback):
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        torch.empty(_MARK, dtype=torch.uint8, device="cuda")  # allocated and freed: a mark in the history


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost slimtune frame of an allocation, else its innermost frame."""
    for f in frames:
        if "/slimtune/" in f["filename"]:
            return f"{f['filename'].split('/slimtune/')[-1]}:{f['line']} {f['name']}"
    if frames:
        f = frames[0]
        return f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
    return "?"


def breakdown(events: list[dict[str, Any]], before: int) -> dict[str, Any]:
    """Replay an allocator history from `before` bytes allocated; the peak overall and per step, with groups."""
    live: dict[int, tuple[int, str]] = {}
    now = before
    freed_before = 0  # bytes of blocks from before the history that were freed during it
    step, peaks = 0, defaultdict(int)
    best, best_live, best_where, best_step, best_freed = -1, {}, "", 0, 0
    for e in events:
        action, size = e["action"], e["size"]
        if action == "alloc":
            if size == _MARK:  # left out of the bytes: it lives for one allocation
                step += 1
                continue
            now += size
            where = _where(e.get("frames", []))
            live[e["addr"]] = (size, where)
            if now > best:
                best, best_live, best_where, best_step, best_freed = now, dict(live), where, step, freed_before
            peaks[step] = max(peaks[step], now)
        elif action == "free_requested" and size != _MARK:
            now -= size
            if live.pop(e["addr"], None) is None:
                freed_before += size
    groups: dict[str, int] = defaultdict(int)
    for size, where in best_live.values():
        groups[where] += size
    groups["(allocated before the history)"] = before - best_freed
    top = sorted(groups.items(), key=lambda kv: -kv[1])
    return {
        "peak_gib": round(best / _GIB, 4),
        "peak_step": best_step,
        "peak_allocation": best_where,
        "per_step_peak_gib": {s: round(b / _GIB, 4) for s, b in sorted(peaks.items())},
        "groups_mib": [(w, round(b / (1 << 20), 1)) for w, b in top if b >= 1 << 20],
    }


def run(model_key: str, batch: int, seq: int, steps: int, graphs: bool, scratch: Path) -> dict[str, Any]:
    from benchmarks.product import prepare_product, train_product

    ps = prepare_product(model_key, batch, seq, steps, "cuda", scratch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        name = f"peak-{model_key}-b{batch}-{'graphs' if graphs else 'eager'}"
        report = train_product(ps, name, batch, seq, steps, "cuda", callbacks=[_StepMarker()], cuda_graphs=graphs)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    out = breakdown(events, before)
    out.update(
        model=model_key,
        batch=batch,
        seq=seq,
        cuda_graphs=report.cuda_graphs,
        max_memory_allocated_gib=round(torch.cuda.max_memory_allocated() / _GIB, 4),
        events=len(events),
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=[k for k in MODEL_SHAPES if k != "tiny"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cuda-graphs", default="on,off", help="on, off or both: the product's train.cuda_graphs")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/slimtune-peak"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for mode in args.cuda_graphs.split(","):
        r = run(args.model, args.batch, args.seq, args.steps, mode == "on", args.scratch)
        name = f"peak-{args.model}-b{args.batch}-{'graphs' if mode == 'on' else 'eager'}.json"
        write_json_atomic(args.out / name, r)
        print(
            f"\n{name}: peak {r['peak_gib']} GiB at step {r['peak_step']} ({r['peak_allocation']}); "
            f"max_memory_allocated {r['max_memory_allocated_gib']}; graphs {r['cuda_graphs']}"
        )
        print("per step:", r["per_step_peak_gib"])
        for where, mib in r["groups_mib"][:24]:
            print(f"  {mib:9.1f} MiB  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
