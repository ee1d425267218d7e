"""Merge an 8B-shaped (Llama-3.1-8B) bf16 model with a rank-16 LoRA on all 7 projections: slimtune's streaming
merge under a 2 GiB GPU / 8 GiB host budget beside peft's merge_and_unload + save_pretrained.

Each phase runs in its own process so peak RSS (sampled every 10 ms, and the kernel's VmHWM) and peak GPU
memory belong to that phase alone. Disk: the 16 GB base stays; each 16 GB output is deleted after its phase
(64 GiB disk). Usage: `python benchmarks/merge_bench.py` (GPU); JSON + markdown go to $OUT (./bench_out).
Env: MERGE_BENCH_DIR (work dir, default /tmp/slimtune_merge_bench), MERGE_BENCH_LAYERS (default 32).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 128256
RANK, ALPHA = 16, 32
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPU_BUDGET, HOST_BUDGET = 2 * 1024**3, 8 * 1024**3
# tensors compared between our output and peft's (ours == peft's bit for bit for source=original; dequantized
# differs by the NF4 rounding, by design)
SAMPLES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.{last}.self_attn.k_proj.weight",
    "model.layers.{last}.mlp.gate_proj.weight",
    "model.layers.{last}.post_attention_layernorm.weight",
    "model.norm.weight",
]
GiB = 1024**3
# lets `python benchmarks/merge_bench.py` import slimtune from a plain checkout
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script with few layers


def _shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    kv = HIDDEN // HEADS * KV_HEADS
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
        ]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


class _Peak:
    """Peak RSS sampled every 10 ms, and peak GPU allocated/reserved from torch's allocator."""

    def __init__(self) -> None:
        self.proc, self.rss, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.rss = max(self.rss, self.proc.memory_info().rss)

    def __enter__(self) -> _Peak:
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
        self._stop.set()
        self._t.join()
        self.rss = max(self.rss, self.proc.memory_info().rss)
        status = Path("/proc/self/status").read_text()
        self.hwm = int(next(l for l in status.splitlines() if l.startswith("VmHWM")).split()[1]) * 1024
        cuda = DEVICE == "cuda"
        self.gpu_alloc = torch.cuda.max_memory_allocated() if cuda else 0
        self.gpu_reserved = torch.cuda.max_memory_reserved() if cuda else 0

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 2),
            "peak_rss_gib": round(self.rss / GiB, 3),
            "vm_hwm_gib": round(self.hwm / GiB, 3),
            "peak_gpu_allocated_gib": round(self.gpu_alloc / GiB, 3),
            "peak_gpu_reserved_gib": round(self.gpu_reserved / GiB, 3),
        }


def _generate(work: Path, layers: int) -> dict:
    """Random bf16 shards written tensor by tensor (one tensor in host memory at a time), an index, config,
    generation config, tokenizer, and a random rank-16 adapter as peft saves it."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    from slimtune.merge.safetensors_io import OutTensor, write_shard
    from slimtune.models.tiny import build_tokenizer

    base, adapter = work / "base", work / "adapter"
    base.mkdir(parents=True)
    t0 = time.perf_counter()
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def chunks(shape: tuple[int, ...]):
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=DEVICE, dtype=torch.bfloat16) * 0.02).cpu()
        yield memoryview(t.view(torch.uint8).numpy())

    groups, size = [[]], 0
    for name, shape in _shapes(layers):
        n = 2 * torch.Size(shape).numel()
        if groups[-1] and size + n > 5 * 10**9:  # transformers' 5 GB default shard size
            groups.append([])
            size = 0
        groups[-1].append(OutTensor(name, "BF16", shape, n, lambda s=shape: chunks(s)))
        size += n
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_shard(base / fname, group, 0)
        weight_map.update({t.name: fname for t in group})
        total += sum(t.nbytes for t in group)
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ).save_pretrained(base)
    GenerationConfig(do_sample=False).save_pretrained(base)
    build_tokenizer().save_pretrained(base)
    LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=PROJECTIONS, task_type="CAUSAL_LM", base_model_name_or_path=str(base)
    ).save_pretrained(adapter)
    lora, gc = {}, torch.Generator().manual_seed(1)
    for name, shape in _shapes(layers):
        if any(f".{p}." in name for p in PROJECTIONS):
            key = "base_model.model." + name.removesuffix(".weight")
            lora[f"{key}.lora_A.weight"] = torch.randn((RANK, shape[1]), generator=gc) / shape[1] ** 0.5
            lora[f"{key}.lora_B.weight"] = torch.randn((shape[0], RANK), generator=gc) * 0.01
    save_file(lora, adapter / "adapter_model.safetensors")
    return {"seconds": round(time.perf_counter() - t0, 2), "base_bytes": total, "lora_tensors": len(lora)}


def _samples(directory: Path, layers: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())["weight_map"] if index_file.exists() else {}
    out = {}
    for name in (s.format(last=layers - 1) for s in SAMPLES):
        with safe_open(directory / index.get(name, "model.safetensors"), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _ours(work: Path, layers: int, source: str) -> dict:
    from safetensors.torch import save_file

    from slimtune.merge import merge_adapter

    out = work / f"ours-{source}"
    kwargs = dict(
        source=source, gpu_budget_bytes=GPU_BUDGET, host_budget_bytes=HOST_BUDGET, temporary_location=work / "spill"
    )
    with _Peak() as peak:
        report = merge_adapter(work / "base", work / "adapter", out, **kwargs)
    save_file(_samples(out, layers), work / f"samples-{source}.safetensors")
    t0 = time.perf_counter()
    rerun = merge_adapter(work / "base", work / "adapter", out, **kwargs)  # hashes inputs and outputs
    spill = work / "spill"
    leftovers = [p.name for p in work.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    leftovers += [p.name for p in spill.iterdir()] if spill.exists() else []
    return {
        **peak.as_dict(),
        "report": report.to_dict(),
        "rerun_reused": rerun.reused,
        "rerun_seconds": round(time.perf_counter() - t0, 2),
        "temporary_leftovers": leftovers,
        "within_gpu_budget": peak.gpu_alloc <= GPU_BUDGET,
        "within_host_budget": peak.rss <= HOST_BUDGET,
    }


def _peft(work: Path, layers: int) -> dict:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = work / "peft"
    with _Peak() as peak:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.bfloat16, device_map=DEVICE)
        model = PeftModel.from_pretrained(model, work / "adapter")
        t1 = time.perf_counter()
        merged = model.merge_and_unload()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        merged.save_pretrained(out)
        t3 = time.perf_counter()
    theirs = _samples(out, layers)
    diffs = {}
    for source in ("original", "dequantized"):
        path = work / f"samples-{source}.safetensors"
        if path.exists():
            ours = load_file(path)
            diffs[source] = {n: float((ours[n].float() - theirs[n].float()).abs().max()) for n in ours}
    return {
        **peak.as_dict(),
        "load_seconds": round(t1 - t0, 2),
        "merge_seconds": round(t2 - t1, 2),
        "save_seconds": round(t3 - t2, 2),
        "bytes_written": sum(p.stat().st_size for p in out.iterdir()),
        "max_abs_diff_vs_ours": diffs,
    }


def _phase(name: str, work: Path, layers: int) -> dict:
    cmd = [sys.executable, __file__, "--phase", name, str(work), str(layers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"phase {name} failed with exit code {proc.returncode}")
    return json.loads((work / f"result-{name}.json").read_text())


def _table(r: dict) -> str:
    rows = [
        "| run | seconds | peak GPU allocated GiB | peak host RSS GiB (sampled / VmHWM) | GB written | spilled |",
        "|---|---|---|---|---|---|",
    ]
    for source in ("original", "dequantized"):
        if f"ours-{source}" in r:
            o = r[f"ours-{source}"]
            rows.append(
                f"| slimtune merge_adapter, source={source}, budgets 2 GiB GPU / 8 GiB host | "
                f"{o['seconds']} | {o['peak_gpu_allocated_gib']} | "
                f"{o['peak_rss_gib']} / {o['vm_hwm_gib']} | "
                f"{o['report']['bytes_written'] / 1e9:.2f} | {o['report']['tensors_spilled']} |"
            )
    p = r["peft"]
    rows.append(
        f"| peft load + merge_and_unload + save_pretrained ({p['load_seconds']} + "
        f"{p['merge_seconds']} + {p['save_seconds']} s) | {p['seconds']} | "
        f"{p['peak_gpu_allocated_gib']} | "
        f"{p['peak_rss_gib']} / {p['vm_hwm_gib']} | {p['bytes_written'] / 1e9:.2f} | - |"
    )
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--phase":
        name, work, layers = sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
        fn = {
            "generate": lambda: _generate(work, layers),
            "peft": lambda: _peft(work, layers),
            "ours-original": lambda: _ours(work, layers, "original"),
            "ours-dequantized": lambda: _ours(work, layers, "dequantized"),
        }[name]
        (work / f"result-{name}.json").write_text(json.dumps(fn(), indent=1))
        return
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("MERGE_BENCH_DIR", "/tmp/slimtune_merge_bench"))
    layers = int(os.environ.get("MERGE_BENCH_LAYERS", "32"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    start = time.perf_counter()
    results: dict = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "layers": layers,
        "disk_free_gb_at_start": round(shutil.disk_usage(work).free / 1e9, 1),
        "host_ram_gib": round(psutil.virtual_memory().total / GiB, 1),
    }
    try:
        results["generate"] = _phase("generate", work, layers)
        print("generated", results["generate"], flush=True)
        for source in ("original", "dequantized"):
            if source == "dequantized" and time.perf_counter() - start > 240:
                results["skipped"] = "ours-dequantized (time budget)"
                continue
            results[f"ours-{source}"] = _phase(f"ours-{source}", work, layers)
            shutil.rmtree(work / f"ours-{source}")
            print(source, {k: v for k, v in results[f"ours-{source}"].items() if k != "report"}, flush=True)
        results["peft"] = _phase("peft", work, layers)
        print("peft", results["peft"], flush=True)
    finally:
        results["total_seconds"] = round(time.perf_counter() - start, 1)
        (out_dir / "merge_bench.json").write_text(json.dumps(results, indent=1))
        shutil.rmtree(work, ignore_errors=True)
    table = _table(results)
    title = f"# merge benchmark ({results['device']}, {layers} layers)"
    (out_dir / "merge_bench.md").write_text(f"{title}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
