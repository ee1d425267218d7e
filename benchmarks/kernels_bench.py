"""Per-kernel speed and memory at Llama-3.1-8B shapes: slimtune's Triton kernels vs PyTorch eager (and
liger-kernel where it has the same kernel and is importable).

Run on a CUDA GPU:  python benchmarks/kernels_bench.py [--tokens 8192] [--kernels fused_linear_ce,rope]
Writes $OUT/kernels_bench.json (OUT defaults to ./bench_out) and prints one line per measurement.

Each kernel is timed forward only and forward+backward (median of `triton.testing.do_bench`), and its
peak extra memory over one forward+backward is recorded. Inputs that the op modifies or that autograd
needs fresh are produced by the same `leaf * 1` copy for every implementation, so the copy cost is
common to all rows of a kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `slimtune`

import torch

H, I, V, HQ, HK, D, R = 4096, 14336, 128256, 32, 8, 128, 16  # Llama-3.1-8B; LoRA rank 16


def _measure(fwd: Callable[[], object], loss_of: Callable[[object], torch.Tensor]) -> dict:
    import triton.testing

    def fwd_bwd():
        loss_of(fwd()).backward()

    fwd_bwd()  # compile / autotune outside the timings
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    with torch.no_grad():
        fwd_ms = triton.testing.do_bench(fwd)
    return {
        "fwd_ms": round(fwd_ms, 4),
        "fwd_bwd_ms": round(triton.testing.do_bench(fwd_bwd), 4),
        "peak_extra_mib": round(peak / 2**20, 1),
    }


def _sum_loss(out) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum(o.float().sum() for o in outs)


def _liger(name: str):
    try:
        import liger_kernel.transformers.functional as lf
    except ImportError:
        return None
    return getattr(lf, name, None)


def bench_rms_norm(n: int) -> dict[str, Callable[[], dict]]:
    from slimtune.kernels.rms_norm import reference_rms_norm, rms_norm

    leaf = torch.randn(n, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(H, device="cuda", dtype=torch.bfloat16)  # frozen, as norms are under LoRA
    impls = {
        "eager": lambda: _measure(lambda: reference_rms_norm(leaf * 1, w, 1e-5), _sum_loss),
        "slimtune": lambda: _measure(lambda: rms_norm(leaf * 1, w, 1e-5), _sum_loss),
    }
    liger = _liger("liger_rms_norm")
    if liger:
        impls["liger"] = lambda: _measure(lambda: liger(leaf * 1, w, 1e-5), _sum_loss)
    return impls


def bench_rope(n: int) -> dict[str, Callable[[], dict]]:
    from slimtune.kernels.rope import reference_rope, rope_

    seq = 2048
    bsz = max(1, n // seq)
    q_leaf = torch.randn(bsz, seq, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_leaf = torch.randn(bsz, seq, HK, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    pos = torch.arange(seq, device="cuda").repeat(bsz, 1)
    emb = torch.cat([pos[..., None] * inv, pos[..., None] * inv], -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    impls = {
        "eager": lambda: _measure(lambda: reference_rope(q_leaf * 1, k_leaf * 1, cos, sin), _sum_loss),
        "slimtune": lambda: _measure(lambda: rope_(q_leaf * 1, k_leaf * 1, cos, sin), _sum_loss),
    }
    liger = _liger("liger_rope")
    if liger:  # liger takes HF's [B, H, T, D] layout: the transposed views attention produces
        impls["liger"] = lambda: _measure(
            lambda: liger((q_leaf * 1).transpose(1, 2), (k_leaf * 1).transpose(1, 2), cos, sin), _sum_loss
        )
    return impls


def bench_gated(n: int, activation: str) -> dict[str, Callable[[], dict]]:
    from slimtune.kernels.swiglu import gated_act, reference_gated_act

    g = torch.randn(n, I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(n, I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    impls = {
        "eager": lambda: _measure(lambda: reference_gated_act(g * 1, u * 1, activation), _sum_loss),
        "slimtune": lambda: _measure(lambda: gated_act(g * 1, u * 1, activation), _sum_loss),
    }
    liger = _liger("liger_swiglu" if activation == "silu" else "liger_geglu")
    if liger:
        impls["liger"] = lambda: _measure(lambda: liger(g * 1, u * 1), _sum_loss)
    return impls


def bench_fused_ce(n: int) -> dict[str, Callable[[], dict]]:
    from slimtune.kernels.fused_linear_ce import fused_linear_cross_entropy, reference_linear_cross_entropy

    hidden = torch.randn(n, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()  # frozen lm_head, as under LoRA
    labels = torch.randint(0, V, (n,), device="cuda")
    labels[: n // 4] = -100
    ident = lambda loss: loss  # noqa: E731
    impls = {
        "eager": lambda: _measure(lambda: reference_linear_cross_entropy(hidden, weight, labels), ident),
        "slimtune": lambda: _measure(lambda: fused_linear_cross_entropy(hidden, weight, labels), ident),
        # the chunk size before the cap was halved: what the smaller chunk costs in time and saves in memory
        "slimtune_1024": lambda: _measure(
            lambda: fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=1024), ident
        ),
    }
    liger = _liger("liger_fused_linear_cross_entropy")
    if liger:
        impls["liger"] = lambda: _measure(lambda: liger(hidden, weight, labels), ident)
    return impls


def bench_nf4(_: int) -> dict[str, Callable[[], dict]]:
    import bitsandbytes.functional as bnbf
    import triton.testing

    from slimtune.kernels.nf4 import dequantize_nf4_scratch

    w = (torch.randn(I, H, device="cuda") * 0.02).bfloat16()
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")

    def timed(fn):
        return lambda: {"fwd_ms": round(triton.testing.do_bench(fn), 4)}

    return {
        "bitsandbytes": timed(lambda: bnbf.dequantize_4bit(packed, state, quant_type="nf4")),
        "slimtune": timed(lambda: dequantize_nf4_scratch(packed, state)),
    }


def bench_lora(n: int, out_f: int, in_f: int) -> dict[str, Callable[[], dict]]:
    import bitsandbytes as bnb
    from peft import LoraConfig, inject_adapter_in_model

    from slimtune.kernels.lora_linear import lora_nf4_linear

    base = bnb.nn.Linear4bit(
        in_f, out_f, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4"
    )
    base.weight = bnb.nn.Params4bit(
        (torch.randn(out_f, in_f) * 0.02).bfloat16(), requires_grad=False, compress_statistics=True, quant_type="nf4"
    )
    base = base.cuda()
    holder = torch.nn.Module()
    holder.proj = base
    config = LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules=["proj"])
    inject_adapter_in_model(config, holder)
    layer = holder.proj.cuda()
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(n, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    state = base.weight.quant_state
    scale = layer.scaling["default"]
    return {
        "peft+bnb": lambda: _measure(lambda: layer(x), _sum_loss),
        "slimtune": lambda: _measure(lambda: lora_nf4_linear(x, base.weight, state, None, a, b, scale), _sum_loss),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch 4 x seq 2048)")
    parser.add_argument("--kernels", default="", help="comma-separated suites to run (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    n = args.tokens
    suites: dict[str, Callable[[], dict[str, Callable[[], dict]]]] = {
        "rms_norm": lambda: bench_rms_norm(n),
        "rope": lambda: bench_rope(n),
        "swiglu": lambda: bench_gated(n, "silu"),
        "geglu": lambda: bench_gated(n, "gelu_tanh"),
        "fused_linear_ce": lambda: bench_fused_ce(n),
        "nf4_dequant_14336x4096": lambda: bench_nf4(n),
        "lora_nf4_q_proj": lambda: bench_lora(n, H, H),
        "lora_nf4_gate_proj": lambda: bench_lora(n, I, H),
        "lora_nf4_down_proj": lambda: bench_lora(n, H, I),
    }
    chosen = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(chosen) - set(suites))
    if unknown:
        print(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(suites)}", file=sys.stderr)
        return 2
    results = []
    for kernel, make in suites.items():
        if chosen and kernel not in chosen:
            continue
        try:
            impls = make()
        except Exception as exc:  # one broken suite must not hide the others' numbers
            results.append({"kernel": kernel, "impl": "-", "error": f"{type(exc).__name__}: {exc}"})
            print(f"{kernel:26s} setup failed: {exc}")
            continue
        rows = {}
        for impl, run in impls.items():
            try:
                rows[impl] = run()
            except Exception as exc:
                rows[impl] = {"error": f"{type(exc).__name__}: {exc}"}
            torch.cuda.empty_cache()
        ref = rows.get("eager") or rows.get("bitsandbytes") or rows.get("peft+bnb") or {}
        for impl, row in rows.items():
            for key in ("fwd_ms", "fwd_bwd_ms"):
                if key in row and key in ref:
                    row[f"speedup_{key}"] = round(ref[key] / row[key], 3)
            results.append({"kernel": kernel, "impl": impl, "tokens": n, **row})
            print(f"{kernel:26s} {impl:12s} " + "  ".join(f"{k}={v}" for k, v in row.items()))
        del impls
        torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "liger": _liger("liger_rms_norm") is not None,
        "results": results,
    }
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".kernels_bench-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, out_dir / "kernels_bench.json")
    print(f"wrote {out_dir / 'kernels_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
