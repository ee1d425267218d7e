#!/usr/bin/env python3
"""Gradient checkpointing modes on the Llama-3.1-8B shape: HF + peft standard checkpointing vs slimtune's
false / true / "unsloth", at batch 1 and 4, measured in one process on one model.

The model is built with random bf16 weights directly on the GPU, its 224 decoder linears are NF4-quantized
in place (double quantization, as a QLoRA load does), and peft attaches LoRA r=16 to all 7 projections.
Each config runs `--warmup` untimed steps and `--steps` timed steps (forward, backward, fused AdamW);
peak allocated/reserved memory covers all of them. An out-of-memory config is recorded, not fatal.

The HF baseline computes its loss the HF way (`labels=`: full logits, upcast to fp32). slimtune's configs
compute it as the pipeline does, with `slimtune.kernels`' fused linear cross-entropy (no full logits): at
batch 4 the fp32 logits alone are 4 GiB (8192 x 128256 x 4 B), twice what offloading saves, so no
checkpointing mode can reach the 8 GiB target beside them. `slimtune_unsloth+hf_loss` isolates the
checkpointing's own effect with the HF loss; `slimtune_unsloth+kernels` adds every kernel
(`apply_kernels(model, "auto")`: RMSNorm, RoPE, SwiGLU, LoRA-NF4 fused too).

Usage: python benchmarks/checkpointing_bench.py [--shape 8b|tiny] [--batches 1,4] [--warmup 2] [--steps 5]
Writes $OUT/checkpointing_bench.json (default ./bench_out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slimtune.train.step import LayerPass, enable_checkpointing

GiB = 1024**3
_SHAPES = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # A CPU smoke test of the harness itself (bitsandbytes NF4 runs on CPU).
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=4096,
    ),
}
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _build(shape: str, device: torch.device) -> nn.Module:
    """Random-init bf16 Llama built on the device, its decoder linears NF4-quantized in place, plus LoRA."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**_SHAPES[shape], rms_norm_eps=1e-5, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # never materialise 32 GB of fp32 weights
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(previous)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name != "lm_head":
                setattr(parent, name, _nf4_linear(bnb, child))
    model.is_loaded_in_4bit = True  # peft picks its bitsandbytes LoRA layers from this flag
    lora = LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", target_modules=_TARGETS
    )
    return get_peft_model(model, lora)


def _nf4_linear(bnb: Any, linear: nn.Linear) -> nn.Module:
    packed, state = bnb.functional.quantize_4bit(
        linear.weight.data, blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    q = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.bfloat16,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    q.weight = bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_state=state,
        blocksize=64,
        compress_statistics=True,
        quant_type="nf4",
        module=q,
        bnb_quantized=True,
    )
    q.quant_state = state
    if linear.bias is not None:
        q.bias = linear.bias
    return q


def _run_config(
    model: nn.Module,
    name: str,
    mode: Any,
    kernels: str | list[str] | None,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    base = model.get_base_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    rec: dict[str, Any] = dict(
        config=name,
        batch=batch,
        seq=args.seq,
        kernels=kernels if isinstance(kernels, str) else ",".join(kernels or ["none"]),
    )
    handle = patch = None
    layer_pass = LayerPass()  # which pass of a checkpointed layer runs, for lora_nf4
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        if mode == "hf":
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            handle = enable_checkpointing(model, mode, layer_pass)
        if kernels is not None:
            from slimtune.kernels import apply_kernels

            patch = apply_kernels(model, kernels, checkpoint_pass=layer_pass)
            if "fused_linear_ce" not in patch.applied:
                raise RuntimeError(f"kernels {kernels}: fused_linear_ce not applied: {patch.skipped}")
            rec["kernels_applied"] = dict(patch.modules)
        model.train()
        opt = torch.optim.AdamW(trainable, lr=1e-4, fused=cuda)
        gen = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, base.config.vocab_size, (batch, args.seq), device=device, generator=gen)
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            losses.append(float(loss.detach()))
            del loss
            if step >= args.warmup:
                times.append(dt)
        rec.update(
            ok=True,
            tokens_per_s=round(batch * args.seq * len(times) / sum(times), 1),
            median_step_s=round(statistics.median(times), 4),
            min_step_s=round(min(times), 4),
            max_step_s=round(max(times), 4),
            loss_first=round(losses[0], 4),
            loss_last=round(losses[-1], 4),
        )
        if handle is not None:
            s = handle.stats()
            rec.update(
                offloading=handle.offloading,
                offloaded_gib_per_step=round(s.offloaded_bytes_per_step / GiB, 3),
                host_buffer_gib=round(s.host_buffer_bytes / GiB, 3),
                pageable_fallback=s.pageable_fallback,
            )
    except torch.OutOfMemoryError as err:
        rec.update(ok=False, error="OOM: " + str(err).splitlines()[0][:200])
    except Exception as err:  # one broken config must not lose the others' numbers
        traceback.print_exc()
        rec.update(ok=False, error=f"{type(err).__name__}: {str(err)[:200]}")
    finally:
        for p in trainable:
            p.grad = None
        if patch is not None:
            patch.undo()
        if mode == "hf":
            base.gradient_checkpointing_disable()
        elif handle is not None:
            handle.undo()
        if cuda:
            rec.update(
                peak_alloc_gib=round(torch.cuda.max_memory_allocated() / GiB, 2),
                peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2),
            )
    print(json.dumps(rec), flush=True)
    return rec


_CONFIGS: dict[str, tuple[Any, str | list[str] | None]] = {  # name -> (mode, slimtune kernels)
    "hf_peft_gc": ("hf", None),
    "slimtune_true": (True, ["fused_linear_ce"]),
    "slimtune_unsloth": ("unsloth", ["fused_linear_ce"]),
    "slimtune_unsloth+hf_loss": ("unsloth", None),
    "slimtune_unsloth+kernels": ("unsloth", "auto"),
    # auto without the fused NF4 LoRA linear: is it worth its place in auto?
    "slimtune_unsloth+kernels-lora_nf4": ("unsloth", ["rms_norm", "rope", "swiglu", "fused_linear_ce"]),
    "slimtune_false": (False, ["fused_linear_ce"]),  # last: the likeliest to run out of memory
}


def _table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| config | batch | kernels | tokens/s | median step s | peak alloc GiB | peak reserved GiB | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        note = r.get("error", "")[:90]
        if r.get("offloading"):
            note = f"offloaded {r['offloaded_gib_per_step']} GiB/step"
            note += " (pageable)" if r["pageable_fallback"] else ""
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['kernels']} | {r.get('tokens_per_s', '-')} | "
            f"{r.get('median_step_s', '-')} | {r.get('peak_alloc_gib', '-')} | "
            f"{r.get('peak_reserved_gib', '-')} | {note} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b", choices=sorted(_SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--configs", default=",".join(_CONFIGS), help="comma-separated, from: " + ", ".join(_CONFIGS))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import bitsandbytes
    import peft
    import transformers

    env = dict(
        torch=torch.__version__,
        transformers=transformers.__version__,
        peft=peft.__version__,
        bitsandbytes=bitsandbytes.__version__,
        device=str(device),
        shape=args.shape,
        gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else None,
    )
    t0 = time.perf_counter()
    model = _build(args.shape, device)
    env["build_s"] = round(time.perf_counter() - t0, 1)
    if device.type == "cuda":
        env["static_alloc_gib"] = round(torch.cuda.memory_allocated() / GiB, 2)
    print(json.dumps(env), flush=True)
    records = [
        _run_config(model, name, *_CONFIGS[name], int(b), args, device)
        for name in args.configs.split(",")
        for b in args.batches.split(",")
    ]
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".checkpointing_bench.json.tmp"
    tmp.write_text(json.dumps(dict(env=env, results=records), indent=1))
    tmp.replace(out / "checkpointing_bench.json")
    print(_table(records))


if __name__ == "__main__":
    main()
