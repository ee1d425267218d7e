"""load_4bit of a real-size model inside a memory cgroup the size of a small machine's RAM.

The loader maps the safetensors shards, so RSS while loading an 8B model reaches ~15.7 GiB, but only ~0.7 GiB
of it is anonymous: the rest is clean file-backed pages the kernel can drop and read again. This runs the
product's `load_4bit` in a cgroup v2 with `memory.max` = LIMIT (page cache counted, no swap) and reports
whether it completed, its peak RSS / anonymous RSS, the cgroup's own peak and its OOM-kill count. Needs root
and a writable /sys/fs/cgroup (the device machine); prints one JSON line.

    python3 benchmarks/bounded_host_load.py --model-dir /tmp/calib/model-8b --limit-gib 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 1024**3
CGROUP = Path("/sys/fs/cgroup/slimtune-bounded-load")


def child(model_dir: str, data: str, root: str) -> None:
    (CGROUP / "cgroup.procs").write_text(str(os.getpid()))  # before anything is loaded
    from calibrate_memory import _base_spec, _record

    from slimtune.memory import guarded
    from slimtune.spec.schema import parse_spec
    from slimtune.tasks.load_4bit import load_4bit

    spec = parse_spec(_base_spec(Path(model_dir), Path(data), Path(root) / "runs", "bounded-load"))
    with guarded("load_4bit", estimate=None, device="cuda") as rec:
        load_4bit(spec)
    print("RESULT " + json.dumps(_record(rec)), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--limit-gib", type=float, default=6.0)
    p.add_argument("--root", default="/tmp/calib")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    data = str(Path(args.root) / "calib.jsonl")
    if args.child:
        child(args.model_dir, data, args.root)
        return 0
    row: dict = {"model_dir": args.model_dir, "limit_gib": args.limit_gib}
    try:
        Path("/sys/fs/cgroup/cgroup.subtree_control").write_text("+memory")
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.max").write_text(str(int(args.limit_gib * GiB)))
        if (CGROUP / "memory.swap.max").exists():
            (CGROUP / "memory.swap.max").write_text("0")
    except OSError as exc:
        print(json.dumps({**row, "outcome": f"no writable cgroup: {exc}"}))
        return 1
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--model-dir", args.model_dir, "--root", args.root],
        capture_output=True,
        text=True,
    )
    result = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    events = dict(line.split() for line in (CGROUP / "memory.events").read_text().splitlines())
    peak = CGROUP / "memory.peak"
    row.update(
        rc=proc.returncode,
        outcome="completed" if result else "failed",
        record=json.loads(result[0]) if result else None,
        cgroup_peak=int(peak.read_text()) if peak.exists() else None,
        oom_kill=int(events.get("oom_kill", 0)),
        stderr_tail=proc.stderr[-600:] if proc.returncode else "",
    )
    print(json.dumps(row))
    return 0 if result else 1


if __name__ == "__main__":
    raise SystemExit(main())
