"""DDP on one host: 1 GPU vs N GPUs at equal effective batch, through slimtune's own training path.

The single-GPU run is the flow's path (load_4bit -> attach_lora -> packed_sft in this process, micro-batch
N*b); the DDP run is `slimtune.train.ddp.launch` (torchrun, N ranks of micro-batch b, NCCL). Both train the
same random-weight model (built locally: no downloads) on the same synthetic chat data with the same seed,
so every optimizer step sees the same rows; the report gives the per-step loss difference (parity) and
tokens/s of both (scaling = DDP tokens/s over all ranks / single-GPU tokens/s).

    python benchmarks/ddp_bench.py --gpus 2 --out $OUT     # JSON to $OUT/ddp_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))

# A ~0.5B Llama (hidden 1536, 16 layers, the tiny tokenizer's vocabulary): big enough that a step is GPU
# bound, small enough that building it and two runs fit in a few minutes.
_SHAPE = dict(
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=96,
    max_position_embeddings=4096,
)


def _build_model(out: Path) -> Path:
    """Random weights in bf16 safetensors plus the builtin ChatML tokenizer, written once."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from slimtune.tiny import ensure_builtin

    tok = AutoTokenizer.from_pretrained(ensure_builtin("builtin:tiny-llama"))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        **_SHAPE,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _write_data(path: Path, examples: int, words: int) -> Path:
    """Chat examples of random corpus words (seeded): enough rows for every step of both runs."""
    sample = _REPO / "deployments" / "data" / "tiny_chat.jsonl"
    vocab = sorted(set(sample.read_text(encoding="utf-8").replace('"', " ").split()))  # words the tokenizer knows
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(examples):
            q = " ".join(rng.choices(vocab, k=words // 4))
            a = " ".join(rng.choices(vocab, k=words))
            f.write(
                json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            )
    return path


def _spec(model_dir: Path, data: Path, out: Path, name: str, gpus: int, args: argparse.Namespace):
    from slimtune.spec import parse_spec

    return parse_spec(
        {
            "name": name,
            "output_dir": str(out),
            "model": {"name_or_path": str(model_dir), "device": "auto"},
            "lora": {"r": 16, "alpha": 16, "gradient_checkpointing": "unsloth"},
            "data": {"path": str(data), "max_seq_length": args.seq, "eval_fraction": 0.02},
            "train": {
                "micro_batch_size": args.micro * (args.gpus // gpus),
                "max_steps": args.steps,
                "learning_rate": 2e-4,
                "warmup_steps": 2,
                "save_steps": args.steps,
                "seed": 0,
                "resume": False,
                "num_gpus": gpus,
            },
            "merge": {"enabled": False},
            "export": {"gguf": []},
        }
    )


def _single(spec) -> dict:
    from slimtune import registry
    from slimtune.tasks.attach_lora import attach_lora
    from slimtune.tasks.load_4bit import load_4bit
    from slimtune.tasks.packed_sft import packed_sft, prepare_data

    loaded = load_4bit(spec)
    lora = attach_lora(spec, loaded.handle)
    examples = prepare_data(spec, loaded.model_dir)
    report = packed_sft(
        spec,
        lora.handle,
        lora.checkpointing_handle,
        examples,
        micro_batch_size=spec.train.micro_batch_size,
        gradient_accumulation_steps=1,
        gradient_checkpointing=spec.lora.gradient_checkpointing,
    )
    registry.release_all()
    return asdict(report)


def main(argv: list[str] | None = None) -> int:
    """Run both configurations, print a summary line and write ddp_bench.json under --out."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--micro", type=int, default=4, help="rows per GPU in the DDP run")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out = Path(args.out)
    work = Path(os.environ.get("DDP_BENCH_WORK", "/tmp/ddp_bench"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = _build_model(work / "model")
    rows_needed = args.steps * args.micro * args.gpus
    data = _write_data(work / "data.jsonl", examples=rows_needed * 4, words=args.seq // 4)

    from slimtune.train import ddp

    began = time.perf_counter()
    single = _single(_spec(model_dir, data, work / "runs", "single", 1, args))
    spec = _spec(model_dir, data, work / "runs", "ddp", args.gpus, args)
    multi = ddp.launch(
        spec, micro_batch_size=args.micro, gradient_accumulation_steps=1, gradient_checkpointing="unsloth"
    )
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(single["losses"], multi["losses"])]
    result = {
        "gpus": args.gpus,
        "micro_per_gpu": args.micro,
        "effective_rows": args.micro * args.gpus,
        "seq": args.seq,
        "steps": args.steps,
        "shape": _SHAPE,
        "single": {k: single[k] for k in ("losses", "tokens_per_s", "eval_loss_after", "seconds")},
        "ddp": {
            k: multi[k]
            for k in ("losses", "tokens_per_s", "tokens_per_s_all_ranks", "ranks", "eval_loss_after", "seconds")
        },
        "loss_abs_diff_max": max(diffs),
        "loss_abs_diff_mean": sum(diffs) / len(diffs),
        "loss_final": [single["losses"][-1]["loss"], multi["losses"][-1]["loss"]],
        "scaling": multi["tokens_per_s_all_ranks"] / single["tokens_per_s"],
        "wall_s": time.perf_counter() - began,
    }
    result["efficiency"] = result["scaling"] / args.gpus
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".ddp_bench.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out / "ddp_bench.json")
    print(
        f"ddp_bench: {args.gpus} GPUs vs 1 at {result['effective_rows']}x{args.seq} tokens/step, {args.steps} "
        f"steps: loss diff max {result['loss_abs_diff_max']:.4f} mean {result['loss_abs_diff_mean']:.4f}, "
        f"final {result['loss_final'][0]:.4f} vs {result['loss_final'][1]:.4f}; tokens/s "
        f"{single['tokens_per_s']:.0f} -> {multi['tokens_per_s_all_ranks']:.0f} "
        f"(x{result['scaling']:.2f}, {100 * result['efficiency']:.0f}% efficiency)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
