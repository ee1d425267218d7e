"""Helpers shared by the fault matrix: the small spec every faulted run uses, OOM injectors, disk checks.

Kept free of pytest fixtures so that `kill_flow.py` (imported by a Prefect worker in another process)
can use it too.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "deployments" / "data" / "tiny_chat.jsonl"

# The tiny pipeline cut to what the faults need: 4 optimizer steps with a checkpoint every 2 (so a kill or
# OOM at step 3 has exactly one complete checkpoint behind it), 128-token rows, one f16 GGUF. Checkpointing
# is off because on the CPU it only costs time (3x, see deployments/tiny.yaml); verification in llama.cpp
# is off because no fault here is about the GGUF's numbers, and it costs ~10 s per run.
BASE_SPEC: dict[str, Any] = {
    "name": "faults",
    "model": {"name_or_path": "builtin:tiny-llama", "device": "cpu"},
    "lora": {"r": 8, "alpha": 16, "gradient_checkpointing": False},
    "data": {"path": str(DATA), "max_seq_length": 128, "eval_fraction": 0.05},
    "train": {
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "learning_rate": 0.002,
        "max_steps": 4,
        "save_steps": 2,
        "seed": 0,
    },
    "export": {"gguf": ["f16"], "verify": False},
}
SAVE_STEPS = BASE_SPEC["train"]["save_steps"]
# Relative L2 distance allowed between the clean adapter and one trained (partly) with the micro-batch
# halved: the same sums in another order, amplified by Adam (g / sqrt(v) is sign(g) on the first step, so
# near-zero gradients can flip). Measured: 8.6e-3 for a run killed at step 3 and resumed from step 2 at
# micro-batch 2 (test_kill); 9.9e-2 for a retry that trained on from already-updated weights (the bug
# test_oom_packed_sft shows). Not yet measured: micro-batch 2 from scratch vs 4, which would split 8.6e-3
# into summation order and resume inexactness.
TRAIN_RTOL = 2e-2


def spec_dict(output_dir: Path, **overrides: dict[str, Any]) -> dict[str, Any]:
    """`BASE_SPEC` writing under `output_dir`, with whole sections updated from `overrides`."""
    data = copy.deepcopy(BASE_SPEC)
    data["output_dir"] = str(output_dir)
    for section, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return data


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(root: Path) -> dict[str, int]:
    """Every file under `root` (relative path -> size), hidden ones included."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(run_dir: Path) -> list[str]:
    """Temporary files and folders (dot-names: staging, *.tmp, spill, old copies) anywhere in a run dir."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*"))


def oom(where: str) -> torch.OutOfMemoryError:
    """The error CUDA's allocator raises, with the text it uses (the guard classifies it by type)."""
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected in {where})")


class Once:
    """Counts calls and says when the `nth` one happens, exactly once (a fault on the first attempt only)."""

    def __init__(self, nth: int = 1) -> None:
        self.nth, self.calls, self.fired = nth, 0, False

    def __call__(self) -> bool:
        self.calls += 1
        if not self.fired and self.calls == self.nth:
            self.fired = True
            return True
        return False


def check_published(run_dir: Path) -> list[str]:
    """Problems with the outputs a run published (non-hidden names); empty when every one is complete.

    Complete means: each checkpoint has its COMPLETE marker; merged/ has a manifest whose hashes match its
    files; each GGUF is read whole by gguf's reader; the adapter's safetensors opens.
    """
    from safetensors import safe_open

    from slimtune.export.gguf_verify import GGUFVerifyError, check_complete

    problems = []
    ckpts = run_dir / "checkpoints"
    for ckpt in sorted(ckpts.glob("checkpoint-*")) if ckpts.is_dir() else []:
        if not (ckpt / "COMPLETE").is_file():
            problems.append(f"{ckpt.name} has no COMPLETE marker")
    merged = run_dir / "merged"
    if merged.exists():
        manifest = merged / "slimtune_manifest.json"
        if not manifest.is_file():
            problems.append("merged/ has no manifest")
        else:
            outputs = json.loads(manifest.read_text())["outputs"]
            for name, digest in outputs.items():
                if not (merged / name).is_file() or sha256(merged / name) != digest:
                    problems.append(f"merged/{name} does not match its manifest")
    for gguf in sorted((run_dir / "gguf").glob("*.gguf")) if (run_dir / "gguf").is_dir() else []:
        try:
            check_complete(gguf)
        except GGUFVerifyError as e:
            problems.append(str(e))
    adapter = run_dir / "adapter" / "adapter_model.safetensors"
    if (run_dir / "adapter").exists():
        try:
            with safe_open(adapter, framework="pt") as f:
                list(f.keys())
        except Exception as e:
            problems.append(f"adapter: {type(e).__name__}: {e}")
    return problems


def adapter_diff(a: Path, b: Path) -> tuple[float, float]:
    """(max |a - b|, ||a - b|| / ||b||) over two adapters' tensors; (inf, inf) when keys or shapes differ."""
    from safetensors.torch import load_file

    ta, tb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    if ta.keys() != tb.keys() or any(ta[k].shape != tb[k].shape for k in ta):
        return float("inf"), float("inf")
    diff = torch.cat([(ta[k].float() - tb[k].float()).flatten() for k in sorted(ta)])
    ref = torch.cat([tb[k].float().flatten() for k in sorted(tb)])
    return diff.abs().max().item(), (diff.norm() / ref.norm()).item()


def run_finetune(data: dict):
    """Validate `data` like the CLI does and run the finetune flow in this process; returns its summary."""
    from slimtune.flows.finetune import finetune
    from slimtune.spec.schema import parse_spec

    return finetune(parse_spec(data))


def fill(disk: Path, leave_bytes: int) -> Path:
    """Fill `disk` with a ballast file until only `leave_bytes` are free (another job filling the disk)."""
    ballast = disk / "ballast"
    free = shutil.disk_usage(disk).free
    with open(ballast, "ab") as f:
        f.write(b"\0" * max(free - leave_bytes, 0))
    return ballast


def stub_model_stages(mp, spans: list[tuple[str, str, float, float]] | None = None, seconds: float = 0.0) -> None:
    """Swap the finetune flow's load/attach/train tasks for fast Prefect tasks, for faults of the flow's wiring.

    Each stub holds for `seconds` and appends (run name, stage, start, end) to `spans`; cleanup, merge and
    export stay real (the spec turns merge and export off).
    """
    import time

    from prefect import task
    from prefect.cache_policies import NO_CACHE

    import slimtune.flows.finetune as finetune_mod
    from slimtune.core import registry

    def _span(spec, stage: str) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        if spans is not None:
            spans.append((spec.name, stage, start, time.monotonic()))

    @task(name="load_4bit", cache_policy=NO_CACHE)
    def load(spec, plan):
        _span(spec, "load_4bit")
        return {"handle": registry.put("model", object())}

    @task(name="attach_lora", cache_policy=NO_CACHE)
    def attach(spec, plan, handle):
        _span(spec, "attach_lora")
        return {"handle": handle, "checkpointing_handle": registry.put("checkpointing", object())}

    @task(name="packed_sft", cache_policy=NO_CACHE)
    def train(spec, plan, handle, checkpointing_handle, examples_handle):
        _span(spec, "packed_sft")
        return {"adapter_dir": str(spec.run_dir() / "adapter"), "steps": 0}

    mp.setattr(finetune_mod, "load_4bit_task", load)
    mp.setattr(finetune_mod, "attach_lora_task", attach)
    mp.setattr(finetune_mod, "packed_sft_task", train)


WIRING_ONLY = {"merge": {"enabled": False}, "export": {"gguf": []}}
