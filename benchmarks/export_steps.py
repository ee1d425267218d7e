"""Merge and GGUF export timings for the benchmark suite: each step runs in a fresh worker process.

`prep` saves a random base (bf16 safetensors + a byte-level BPE tokenizer) and a non-identity LoRA adapter;
`merge` times `slimtune.merge.merge_adapter` on them; `gguf` times `slimtune.export.convert_hf_to_gguf`
(f16) on the merged model (or on the base when no merge ran). A step whose slimtune module does not
import is recorded as "not available".
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    LORA_RANK,
    LORA_TARGETS,
    MODEL_SHAPES,
    GpuPeak,
    build_random_model,
    dir_bytes,
    error_text,
    gib,
)
from slimtune.memory.sampler import PeakSampler


def _measure(step: str, fn: Callable[[], list[Path]], device: str) -> dict[str, Any]:
    """Time `fn`, with its peak GPU memory, peak host RSS and the bytes of the paths it returns."""
    rec: dict[str, Any] = {"kind": "export", "step": step, "status": "ok", "error": None}
    rss, mem = PeakSampler("cpu", interval_s=0.02), GpuPeak(device)
    t0 = time.perf_counter()
    try:
        with rss, mem:
            written = fn()
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        rec["bytes_written"] = sum(dir_bytes(p) for p in written)
    except Exception as e:
        traceback.print_exc()
        rec.update(status="error", error=error_text(e))
    rec.update(peak_gpu_allocated_gib=gib(mem.peak_allocated), host_rss_peak_gib=gib(rss.peak_host_rss))
    return rec


def export_step(step: str, model_key: str, device: str, scratch: Path) -> dict[str, Any]:
    """One of `prep`, `merge`, `gguf`; run each in a fresh process so that its peaks are its own.

    The slimtune module is imported before the clock starts: import time is not export time.
    """
    base_dir, adapter_dir = scratch / f"base-{model_key}", scratch / f"adapter-{model_key}"
    merged_dir, gguf_path = scratch / f"merged-{model_key}", scratch / f"model-{model_key}-f16.gguf"
    extra: dict[str, Any] = {}
    try:
        if step == "prep":
            from peft import LoraConfig, get_peft_model

            from slimtune.models.tiny import build_tokenizer  # a byte-level BPE the GGUF converter maps to llama.cpp

            def fn() -> list[Path]:
                model = build_random_model(MODEL_SHAPES[model_key], device)
                model.save_pretrained(str(base_dir), max_shard_size="2GB")
                build_tokenizer().save_pretrained(str(base_dir))
                # init_lora_weights=False draws B at random too: the merge really changes every target.
                cfg = LoraConfig(
                    r=LORA_RANK,
                    lora_alpha=LORA_RANK,
                    lora_dropout=0.0,
                    init_lora_weights=False,
                    task_type="CAUSAL_LM",
                    target_modules=list(LORA_TARGETS),
                )
                get_peft_model(model, cfg).save_pretrained(str(adapter_dir))
                return [base_dir, adapter_dir]
        elif step == "merge":
            from slimtune.merge import merge_adapter

            def fn() -> list[Path]:
                # slimtune's own report (budgets, spills, its peaks) is kept beside our measurements
                extra["report"] = merge_adapter(base_dir, adapter_dir, merged_dir, device=device).to_dict()
                return [merged_dir]
        elif step == "gguf":
            from slimtune.export import convert_hf_to_gguf

            def fn() -> list[Path]:
                return convert_hf_to_gguf(merged_dir if merged_dir.is_dir() else base_dir, gguf_path, "f16")
        else:
            raise ValueError(f"unknown export step {step!r}; use prep, merge or gguf")
    except ImportError as e:
        return {"kind": "export", "step": step, "model": model_key, "status": "not available", "error": error_text(e)}
    rec = _measure("gguf f16" if step == "gguf" else step, fn, device)
    rec.update(model=model_key, **extra)
    return rec
