"""Shared pieces of the benchmark suite: model shapes, random NF4 + LoRA models, timing, memory, rows.

Everything heavy (transformers, peft, bitsandbytes) is imported inside functions: the Unsloth worker must
import `unsloth` before transformers or its patches are skipped, and it imports this module first.
Nothing here downloads: configs are written out from the public model cards and weights are random.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimtune.memory.sampler import PeakSampler  # imports neither transformers nor peft

GiB = 1024**3
# hf_gc: HF + peft + bitsandbytes with checkpointing (the baseline of every ratio); hf_nogc: without;
# liger: hf_gc + liger-kernel; unsloth: Unsloth; ours: slimtune's kernels in the hand loop (a diagnostic);
# product: slimtune's attach_lora + packed_sft task functions (benchmarks/product.py); product_sdpa: the same
# with packed rows on SDPA's dense block mask, product_eager: with train.cuda_graphs false (diagnostics). Also the
# order of every table.
CONFIGS = ("hf_gc", "hf_nogc", "liger", "unsloth", "product", "ours", "product_sdpa", "product_eager")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 16
SEED = 0


@dataclass(frozen=True)
class ModelShape:
    """A model's architecture with no weights: enough to build it at random."""

    key: str
    name: str  # the public model whose config.json this mirrors
    family: str  # transformers model_type
    config: dict[str, Any] = field(default_factory=dict)


_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
MODEL_SHAPES: dict[str, ModelShape] = {
    "1b": ModelShape(
        "1b",
        "Llama-3.2-1B",
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            bos_token_id=128000,
            eos_token_id=128001,
            rope_parameters={**_LLAMA3_ROPE, "factor": 32.0},
        ),
    ),
    "8b": ModelShape(
        "8b",
        "Llama-3.1-8B",
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            bos_token_id=128000,
            eos_token_id=128001,
            rope_parameters={**_LLAMA3_ROPE, "factor": 8.0},
        ),
    ),
    "qwen7b": ModelShape(
        "qwen7b",
        "Qwen2.5-7B",
        "qwen2",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            bos_token_id=151643,
            eos_token_id=151643,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # google/gemma-3-1b-it's config.json (999,885,952 parameters): 5 sliding-window layers of 512 with a
    # local rope base of 10k, then one global layer with 1M; one KV head of 256; tied 262k-row embedding.
    "gemma3_1b": ModelShape(
        "gemma3_1b",
        "Gemma-3-1B",
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
            sliding_window=512,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
            rope_parameters={
                "full_attention": dict(rope_type="default", rope_theta=1000000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            },
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    # google/gemma-3-4b-it's config.json, the multimodal checkpoint as released (Gemma3ForConditionalGeneration):
    # a 34-layer language model (5 sliding layers of 1024, then a global one with linear rope scaling 8), SigLIP's
    # 27-layer 896-pixel vision tower and the projector beside it; 4.30B parameters.
    "gemma3_4b": ModelShape(
        "gemma3_4b",
        "Gemma-3-4B (multimodal)",
        "gemma3",
        dict(
            text_config=dict(
                hidden_size=2560,
                intermediate_size=10240,
                num_hidden_layers=34,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                vocab_size=262208,
                max_position_embeddings=131072,
                rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=256,
                sliding_window=1024,
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)],
                rope_parameters={
                    "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                    "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                },
            ),
            vision_config=dict(
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                image_size=896,
                patch_size=14,
                vision_use_head=False,
            ),
            mm_tokens_per_image=256,
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    # Qwen/Qwen3.5-4B's language model (qwen3_5_text): 32 layers, three Gated DeltaNet layers (16 key heads, 32
    # value heads of 128) then one gated full-attention layer (16 heads on 4 KV heads of 256, a quarter rotating),
    # 248k vocabulary.
    "qwen35_4b": ModelShape(
        "qwen35_4b",
        "Qwen3.5-4B (language model)",
        "qwen3_5_text",
        dict(
            hidden_size=2560,
            intermediate_size=9216,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            linear_conv_kernel_dim=4,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            vocab_size=248320,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
            bos_token_id=248044,
            eos_token_id=248044,
        ),
    ),
    # Qwen/Qwen3-30B-A3B's config.json (30.5B parameters, 3.3B active): 48 layers, each of 128 experts of 768
    # (8 per token) behind 32 query heads on 4 KV heads of 128; 152k vocabulary, untied head. ~57 GiB in bf16.
    "qwen3_30b_a3b": ModelShape(
        "qwen3_30b_a3b",
        "Qwen3-30B-A3B",
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    # openai/gpt-oss-20b's config.json (20.9B parameters, 3.6B active) with its experts in bf16 (the release holds
    # them in MXFP4): 24 layers alternating 128-token sliding and full attention with sinks, 32 experts of 2880
    # (4 per token, clamped SwiGLU, biases), 64 query heads on 8 KV heads of 64, yarn rope; 201k vocabulary.
    "gpt_oss_20b": ModelShape(
        "gpt_oss_20b",
        "gpt-oss-20b (bf16 experts)",
        "gpt_oss",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            router_aux_loss_coef=0.9,
            swiglu_limit=7.0,
            num_hidden_layers=24,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
            sliding_window=128,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            attention_bias=True,
            vocab_size=201088,
            max_position_embeddings=131072,
            initial_context_length=4096,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=4096,
                truncate=False,
            ),
            eos_token_id=200002,
            pad_token_id=199999,
        ),
    ),
    # microsoft/Phi-3-mini-4k-instruct's config.json (3,821,079,552 parameters): fused qkv_proj and
    # gate_up_proj, 32 full heads (no GQA), a 2047-token sliding window, untied head.
    "phi3_mini": ModelShape(
        "phi3_mini",
        "Phi-3-mini-4k",
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            sliding_window=2047,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            bos_token_id=1,
            eos_token_id=32000,
            pad_token_id=32000,
        ),
    ),
    # FSDP-QLoRA's target: ~9.2 GiB of NF4 weights (1.45 GiB each for the bf16 input table and lm_head),
    # more than one 12 GiB budget holds with a step's activations, half of it per rank on two GPUs.
    "qwen14b": ModelShape(
        "qwen14b",
        "Qwen2.5-14B",
        "qwen2",
        dict(
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=48,
            num_attention_heads=40,
            num_key_value_heads=8,
            vocab_size=152064,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            bos_token_id=151643,
            eos_token_id=151643,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # 14.1B parameters: Qwen2.5-14B's layers (50 of them) with a 32k vocabulary (Llama-2/Mistral's size) in
    # place of its 152k. Under FSDP1 the input table and lm_head stay gathered for every step; with 152k of
    # them an FSDP rank holds more than one GPU running slimtune's best settings (benchmarks/ddp_bench.py).
    "qwen14b-v32k": ModelShape(
        "qwen14b-v32k",
        "Qwen2.5-14B layers x 50, 32k vocabulary",
        "qwen2",
        dict(
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=50,
            num_attention_heads=40,
            num_key_value_heads=8,
            vocab_size=32768,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    # CPU smoke tests only: every code path of the real shapes (GQA, untied head) at toy size.
    "tiny": ModelShape(
        "tiny",
        "tiny-llama",
        "llama",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=1024,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # CPU checks of benchmarks/families_bench.py: the two shapes above at toy size (their quirks kept).
    "tiny_gemma3": ModelShape(
        "tiny_gemma3",
        "tiny-gemma3",
        "gemma3_text",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            vocab_size=1024,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=64,
            sliding_window=16,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)],
            rope_parameters={
                "full_attention": dict(rope_type="default", rope_theta=1000000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            },
        ),
    ),
    "tiny_phi3": ModelShape(
        "tiny_phi3",
        "tiny-phi3",
        "phi3",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=1056,
            max_position_embeddings=2048,
            sliding_window=2047,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,  # Phi3Config's default 32000 is past this vocabulary
        ),
    ),
    # CPU checks of benchmarks/user_compare.py's mixture-of-experts rows: the two MoE shapes at toy size.
    "tiny_qwen3_moe": ModelShape(
        "tiny_qwen3_moe",
        "tiny-qwen3_moe",
        "qwen3_moe",
        dict(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=1024,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
    "tiny_gpt_oss": ModelShape(
        "tiny_gpt_oss",
        "tiny-gpt_oss",
        "gpt_oss",
        dict(
            hidden_size=128,
            intermediate_size=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=1024,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=150000.0),
            pad_token_id=0,
        ),
    ),
}


def build_config(shape: ModelShape):
    """The transformers config for `shape`, without a KV cache (training)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(shape.family, **shape.config)
    cfg.use_cache = False
    return cfg


def build_random_model(
    shape: ModelShape, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = SEED
) -> torch.nn.Module:
    """Allocate and initialise the model directly on `device` in `dtype` (no host copy: an 8B model in
    bf16 is 16 GB, which would otherwise pass through host RAM)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(build_config(shape), dtype=dtype, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    return model


def quantize_nf4_(model: torch.nn.Module) -> int:
    """Replace every nn.Linear except lm_head by a bitsandbytes NF4 Linear4bit (double quant), in place.

    Same result as `from_pretrained(quantization_config=BitsAndBytesConfig(nf4, double quant))` without
    the save/load round trip: the 8B shape quantizes in ~0.2 s on an H100 instead of a 16 GB disk trip.
    Returns the number of layers replaced.
    """
    import bitsandbytes as bnb

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=torch.bfloat16,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=torch.uint8,
                device="meta",
            )
            weight = bnb.nn.Params4bit(
                child.weight.data,
                requires_grad=False,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=torch.uint8,
                module=q,
            )
            q.weight = weight.to(child.weight.device)  # .to() on an unquantized Params4bit quantizes it
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, q)
            replaced += 1
    # peft dispatches its bnb LoRA layer only when the model says it is 4-bit (what HF's quantizer sets).
    model.is_loaded_in_4bit = True
    return replaced


def attach_lora(model: torch.nn.Module, rank: int = LORA_RANK):
    """peft LoRA of rank `rank` (alpha = rank, no dropout) on the seven projections, as in the reference
    (where the family fuses them, Phi-3's qkv_proj and gate_up_proj, on the fused ones, as slimtune does)."""
    from peft import LoraConfig, get_peft_model

    from slimtune.models.lora_targets import lora_target_modules

    targets = lora_target_modules(model.config.model_type, list(LORA_TARGETS))
    cfg = LoraConfig(
        r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", target_modules=targets
    )
    return get_peft_model(model, cfg)


def reset_lora_(model: torch.nn.Module, seed: int = SEED) -> int:
    """Re-initialise every LoRA pair (A random from `seed`, B zero) so each row starts from one state.

    With B = 0 the first loss of every config on a given batch is the same up to kernel rounding; a row
    whose first loss differs from hf_gc's by more than that is computing something else.
    """
    torch.manual_seed(seed)
    n = 0
    for module in model.modules():
        if hasattr(module, "reset_lora_parameters") and "default" in getattr(module, "lora_A", {}):
            module.reset_lora_parameters("default", True)
            n += 1
    return n


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates (the LoRA factors)."""
    return [p for p in model.parameters() if p.requires_grad]


def random_batch(vocab_size: int, batch: int, seq: int, device: str, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Token ids drawn uniformly from the vocabulary; labels equal inputs (transformers shifts them)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def synchronize(device: str) -> None:
    """Wait for queued GPU work so that host timers measure it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class ProcessRssSampler:
    """Peak host RSS of this process, sampled every `interval_s` by a child process reading /proc.

    The in-process sampler thread (slimtune.memory.sampler) wakes every 20 ms and takes the GIL from the
    training loop, whose batch-1 steps are host-bound; from another process the training loop pays nothing
    between `__enter__` and `__exit__`.
    """

    _CHILD = (
        "import os, select, sys\n"
        "pid, dt, page, peak = sys.argv[1], float(sys.argv[2]), os.sysconf('SC_PAGE_SIZE'), 0\n"
        "while True:\n"
        "    with open(f'/proc/{pid}/statm') as f:\n"
        "        peak = max(peak, int(f.read().split()[1]) * page)\n"
        "    if select.select([sys.stdin], [], [], dt)[0]:\n"
        "        break\n"
        "print(peak, flush=True)\n"
    )

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.start_host_rss = self.peak_host_rss = 0
        self._child: subprocess.Popen | None = None

    @staticmethod
    def _rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def __enter__(self) -> ProcessRssSampler:
        self.start_host_rss = self.peak_host_rss = self._rss()
        self._child = subprocess.Popen(
            [sys.executable, "-c", self._CHILD, str(os.getpid()), str(self.interval_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._child.communicate(input="")  # EOF on its stdin ends the loop; it prints the peak
        self.peak_host_rss = max(self.peak_host_rss, self._rss(), int(out.strip() or 0))


class ThreadRssSampler(PeakSampler):
    """The in-process sampler thread, kept to compare against `ProcessRssSampler` (`--rss-sampler thread`)."""

    def __init__(self, interval_s: float = 0.02) -> None:
        super().__init__("cpu", interval_s=interval_s)


RSS_SAMPLERS = {"process": ProcessRssSampler, "thread": ThreadRssSampler}


class GpuPeak:
    """Allocator high-water marks over a block: reset on entry, read on exit (None off CUDA)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.static_allocated: int | None = None
        self.peak_allocated: int | None = None
        self.peak_reserved: int | None = None

    def __enter__(self) -> GpuPeak:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.static_allocated = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_allocated = torch.cuda.max_memory_allocated()
            self.peak_reserved = torch.cuda.max_memory_reserved()


def run_steps(
    step: Callable[[], torch.Tensor], warmup: int, steps: int, device: str
) -> tuple[list[float], list[float]]:
    """Run `warmup + steps` training steps; return the timed steps' seconds and every step's loss.

    Each step is bracketed by a device synchronize so the host clock covers the GPU work, including the
    host-side overhead a real training loop pays (Python, launches, allocator).
    """
    times, losses = [], []
    for i in range(warmup + steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss = step()
        synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if i >= warmup:
            times.append(dt)
    return times, losses


def step_stats(times: list[float], tokens_per_step: int) -> dict[str, float]:
    """tokens/s from the median timed step, and min/median/max so that noise is visible."""
    med = statistics.median(times)
    return {
        "tokens_per_s": round(tokens_per_step / med, 1),
        "step_s_min": round(min(times), 4),
        "step_s_median": round(med, 4),
        "step_s_max": round(max(times), 4),
        "steps_timed": len(times),
    }


def gib(n: int | None) -> float | None:
    """Bytes to GiB, two decimals; None stays None (no GPU)."""
    return None if n is None else round(n / GiB, 2)


def dir_bytes(path: Path) -> int:
    """Total size of the regular files under `path` (or of `path` itself)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def save_word_tokenizer(out_dir: Path, vocab_words: int = 252) -> None:
    """A small word-level fast tokenizer for loaders that insist on one next to the weights (Unsloth)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(vocab_words)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(str(out_dir))


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name in the same folder and rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """JSON with sorted keys and a trailing newline, written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def markers(name: str) -> tuple[str, str]:
    """The lines that enclose generated section `name` in a markdown file."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def generated_section(text: str, name: str) -> str:
    """What lies between section `name`'s markers in `text`; ValueError naming the missing lines."""
    start, end = markers(name)
    if start not in text or end not in text or text.index(start) > text.index(end):
        raise ValueError(f"add the lines '{start}' and '{end}' where the generated {name} section goes")
    return text.split(start, 1)[1].split(end, 1)[0].removeprefix("\n")


def replace_section(path: Path, name: str, section: str) -> None:
    """Put `section` between section `name`'s markers in the file at `path`, atomically."""
    text = path.read_text(encoding="utf-8")
    try:
        generated_section(text, name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    start, end = markers(name)
    head, rest = text.split(start, 1)
    write_text_atomic(path, f"{head}{start}\n{section}{end}{rest.split(end, 1)[1]}")


ERROR_CHARS = 400  # an error in a row is one line, enough to name the cause
VERSIONED = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "triton",
    "liger-kernel",
    "unsloth",
    "unsloth_zoo",
    "trl",
    "flash-attn",  # the baselines' usual attention kernels: without them they run on SDPA
    "xformers",
    "gguf",
    "prefect",
)


def error_text(e: BaseException) -> str:
    """`Type: first line of the message`, short enough for a table cell."""
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"[:ERROR_CHARS]


def free_memory(device: str) -> None:
    """Drop garbage and return cached GPU blocks, so the next row's reserved peak starts from its own."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def trim_host_heap() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise, inflating later RSS readings)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def package_version(dist: str) -> str | None:
    """The installed version of distribution `dist`, without importing it; None when absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    """Versions and the GPU, read without creating a CUDA context (nvidia-smi, package metadata)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "device": device,
        "versions": {d: package_version(d) for d in VERSIONED},
    }
    if device.startswith("cuda"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            name, mem, driver = [s.strip() for s in out.stdout.splitlines()[0].split(",")]
            env.update(gpu=name, gpu_memory=mem, driver=driver)
        except (OSError, IndexError, ValueError, subprocess.TimeoutExpired) as e:
            env["gpu"] = f"unknown ({error_text(e)})"
    else:
        env.update(gpu=None, cpu=platform.machine())
    return env


def command_line(script: str, argv: list[str]) -> str:
    """The command as typed (`python3 SCRIPT ARGS`), with the device tool's output folder written as $OUT."""
    out_env = os.environ.get("OUT")
    words = ["python3", script, *[("$OUT" if out_env and a == out_env else a) for a in argv]]
    return " ".join(w if w == "$OUT" else shlex.quote(w) for w in words)


def make_row(model_key: str, config: str, batch: int, seq: int, status: str, **extra: Any) -> dict[str, Any]:
    """A result row; measured fields are added by `measure_training`, failures carry `error`."""
    return {
        "kind": "row",
        "model": model_key,
        "model_name": MODEL_SHAPES[model_key].name,
        "config": config,
        "batch": batch,
        "seq": seq,
        "status": status,
        "error": None,
        **extra,
    }


def measure_training(
    model: torch.nn.Module,
    loss_fn: Callable,
    *,
    model_key: str,
    config: str,
    batch: int,
    seq: int,
    warmup: int,
    steps: int,
    device: str,
    notes: dict[str, Any] | None = None,
    rss_sampler: str = "process",
) -> dict[str, Any]:
    """Train `warmup + steps` steps of one (config, batch) and return its row; never raises.

    Every row starts from the same LoRA init and the same batch, under bf16 autocast with AdamW, with
    the allocator peaks reset and the host RSS sampled over all its steps (warm-up included: a
    first-step spike is still memory the GPU must have).
    """
    free_memory(device)
    reset_lora_(model)
    model.train()
    data = random_batch(model.config.vocab_size, batch, seq, device)
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.startswith("cuda"))
    dev_type = device.split(":")[0]

    def step() -> torch.Tensor:
        with torch.autocast(dev_type, dtype=torch.bfloat16):
            loss = loss_fn(model, data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    rss, mem = RSS_SAMPLERS[rss_sampler](), GpuPeak(device)
    row = make_row(model_key, config, batch, seq, "ok", warmup=warmup, notes=notes or {}, rss_sampler=rss_sampler)
    try:
        with rss, mem:
            times, losses = run_steps(step, warmup, steps, device)
        row.update(step_stats(times, batch * seq), loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4))
        if not all(math.isfinite(x) for x in losses):  # NaN/inf: a broken run, not a speed
            row.update(status="error", error=f"non-finite loss: {losses}")
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=error_text(e))
    except Exception as e:  # a broken config must not take the rest of the suite down
        traceback.print_exc()
        row.update(status="error", error=error_text(e))
    finally:
        opt.zero_grad(set_to_none=True)
        opt.state.clear()  # AdamW's two moments per LoRA weight; the next row allocates its own
        free_memory(device)
    row.update(memory_fields(mem, rss))
    return row


def memory_fields(mem, rss) -> dict:
    """A row's memory columns from its GPU peak tracker and host RSS sampler."""
    return {
        "peak_allocated_gib": gib(mem.peak_allocated),
        "peak_reserved_gib": gib(mem.peak_reserved),
        "static_allocated_gib": gib(mem.static_allocated),
        "host_rss_start_gib": gib(rss.start_host_rss),
        "host_rss_peak_gib": gib(rss.peak_host_rss),
    }


REPO_ROOT = Path(__file__).resolve().parent.parent
LOG_TAIL = 3000  # characters of a worker's log kept in a result row


def _card_used() -> int | None:
    """The card's used memory (nvidia-smi, GPU 0), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
    )
    return int(done.stdout.split()[0]) * 2**20 if done.returncode == 0 and done.stdout.strip() else None


def run_process(
    cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
) -> dict[str, Any]:
    """Run `cmd` in `cwd`, in its own process group, under `timeout` seconds, output to `log`.

    Returns rc (None when killed at the timeout), wall_s, the peak RSS of the process tree in bytes (wait4's
    ru_maxrss: the largest of the process and the children it waited for), the card's peak used memory while it
    ran less the card's use before it started (nvidia-smi every 0.5 s from outside: what the card had to hold
    for it, context and libraries included; None without a GPU) and the log's tail. Whatever the group leaves
    behind (a server a tool started) is killed with it.
    """
    t0 = time.monotonic()
    idle, card_peak, sampled = _card_used(), None, 0.0
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        rc: int | None = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                _pid, status, usage = os.wait4(proc.pid, 0)
                break
            if idle is not None and time.monotonic() - sampled >= 0.5:
                sampled = time.monotonic()
                used = _card_used()
                card_peak = max(card_peak or 0, used - idle) if used is not None else card_peak
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return {
        "rc": rc,
        "wall_s": round(time.monotonic() - t0, 1),
        "host_rss_peak": usage.ru_maxrss * 1024,  # KiB on Linux
        "card_peak": card_peak,
        "tail": log.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL:],
    }
