#!/usr/bin/env python3
"""How fast each CPU core of this machine runs the host side of a training step, one core at a time.

The 1B and batch-1 cells are bound by the host, and the device machines are virtual (Firecracker, 16
vCPUs): if the cores are not equally fast, the same step's time depends on where the scheduler
puts the process, and a config measured once per process carries that noise into its ratios. Per core, a
child process pinned to it (`os.sched_setaffinity`) times a pure-Python loop (ns per iteration) and a CUDA
launch (`x.add_(1)` on 16 floats, us per launch, queued without waiting), each the median of a few repeats.

    python3 benchmarks/core_speed.py --out "$OUT"
Writes OUT/core-speed.json and prints one line per core; `--rounds 2` measures every core twice, apart in
time, to tell a slow core from a slow moment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, write_json_atomic

_LOOP = 2_000_000
_LAUNCHES = 5000


def _python_ns() -> float:
    t0 = time.perf_counter()
    total = 0
    for i in range(_LOOP):
        total += i
    return (time.perf_counter() - t0) * 1e9 / _LOOP


def _launch_us(x) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(_LAUNCHES):
        x.add_(1)
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt * 1e6 / _LAUNCHES


def measure(core: int) -> dict[str, float | int]:
    """Pin this process to `core` and time both loops there (after two untimed passes)."""
    import torch

    os.sched_setaffinity(0, {core})
    x = torch.zeros(16, device="cuda")
    for _ in range(2):
        _python_ns()
        _launch_us(x)
    return {
        "core": core,
        "python_ns": round(statistics.median(_python_ns() for _ in range(3)), 1),
        "launch_us": round(statistics.median(_launch_us(x) for _ in range(5)), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--core", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.core is not None:
        print(json.dumps(measure(args.core)), flush=True)
        return 0
    rows = []
    for rnd in range(args.rounds):
        for core in sorted(os.sched_getaffinity(0)):
            cmd = [sys.executable, __file__, "--core", str(core)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row = {**json.loads(proc.stdout.splitlines()[-1]), "round": rnd}
            rows.append(row)
            print(
                f"round {rnd} core {core:>3}: {row['python_ns']:6.1f} ns per Python iteration, "
                f"{row['launch_us']:6.2f} us per launch",
                flush=True,
            )
    for key in ("python_ns", "launch_us"):
        values = [r[key] for r in rows]
        print(f"{key}: fastest {min(values)}, slowest {max(values)} ({max(values) / min(values):.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "core-speed.json"
    write_json_atomic(path, {"command": " ".join(sys.argv), "environment": environment("cuda"), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
