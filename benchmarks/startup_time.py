"""Start-up time of `slimtune run`: process start to the first training step's line, for one or more source trees.

Start-up is what a user waits through before training shows progress: imports, the spec and data checks, the
temporary Prefect server, load_4bit, attach_lora and the step-0 evaluation. Each tree runs its own copy of the spec in
turn (`PYTHONPATH=<tree>`, a fresh output folder per run), interleaved so that drift on the machine falls on
both; the first `step N/M loss` line is timed as it arrives on stdout.

    python benchmarks/startup_time.py --spec deployments/tiny.yaml --tree before=/tmp/old --tree after=. \
        --runs 3 --out startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

_STEP = re.compile(r"step (\d+)/\d+ loss")


def _entry_point(tree: Path) -> str:
    """The tree's own `slimtune` console script ("module:function"), as pip would install it."""
    return tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["slimtune"]


def time_one(tree: Path, spec: Path, max_steps: int, stop_at_first_step: bool) -> dict:
    """One `slimtune run` of `spec` from `tree`: seconds to the first step line, to exit, and CPU seconds."""
    path = os.pathsep.join(p for p in (str(tree.resolve()), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with tempfile.TemporaryDirectory() as out:
        module, function = _entry_point(tree).split(":")
        launch = f"import sys; from {module} import {function}; sys.exit({function}())"
        cmd = [sys.executable, "-c", launch, "run", str(spec), "--set", f"output_dir={out}"]
        cmd += ["--set", f"train.max_steps={max_steps}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        first: float | None = None
        step: int | None = None
        # cwd: `python -c` puts it first on sys.path, where another checkout would shadow the tree
        proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            match = _STEP.search(line)
            if first is None and match:
                first, step = time.perf_counter() - start, int(match.group(1))
                if stop_at_first_step:  # the rest is training, not start-up: end the run and its server
                    os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
        total = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "rc": rc,
        "first_step_s": first,
        "first_step": step,
        "total_s": total,
        "cpu_s": cpu,
        "tail": tail if rc or first is None else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=Path("deployments/tiny.yaml"), help="relative to each tree")
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree (repeatable)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=4, help="train.max_steps: start-up is what is timed")
    parser.add_argument("--stop-at-first-step", action="store_true", help="kill each run at its first step line")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.tree)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, path in trees.items():
            result = time_one(Path(path), (Path(path) / args.spec).resolve(), args.max_steps, args.stop_at_first_step)
            runs[name].append(result)
            print(name, {k: v for k, v in result.items() if k != "tail"}, flush=True)
    summary = {
        name: {
            "median_first_step_s": statistics.median(r["first_step_s"] for r in rs if r["first_step_s"] is not None)
            if any(r["first_step_s"] is not None for r in rs)
            else None,
            "median_cpu_s": statistics.median(r["cpu_s"] for r in rs),
        }
        for name, rs in runs.items()
    }
    args.out.write_text(
        json.dumps(
            {"cpus": os.cpu_count(), "spec": str(args.spec), "command": sys.argv, "summary": summary, "runs": runs},
            indent=1,
        )
    )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
