"""Memory estimates for each stage, from a Hugging Face `config.json` dict and plain numbers.

The estimates exist so a run fails in one second with advice instead of after twenty minutes of
loading. They count what dominates (weights, LoRA and optimizer state, saved activations, logits,
the CUDA context) and are calibrated against GPU measurements of the real stages
(benchmarks/results/memory/, made by benchmarks/calibrate_memory.py): tests/test_memory_calibration.py
holds every measured cell to [1.0, 1.15] x measured. See the comments next to each term.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from slimtune.core.gguf_types import GGUF_TYPES
from slimtune.memory.activations import (
    EAGER_SCORES_RECOMPUTE,
    LINEAR_ATTENTION_ACTIVATIONS,
    bytes_per_token_layer,
    eager_scores_bytes_per_token_layer,
    varlen_bytes_per_token_layer,
)
from slimtune.memory.model_shape import ModelShape, model_shape
from slimtune.memory.stage_estimate import FRAGMENTATION_TERM, Estimate
from slimtune.models.lora_targets import canonical_targets

_GIB = 1024**3

# Host memory is measured as the stage needs it (benchmarks/results/memory/): RSS while training (the
# pinned offload buffers are shared pages, not anonymous ones, but are real memory), anonymous RSS while
# loading, merging and exporting (safetensors shards and GGUF files are mapped: file-backed pages the
# kernel can drop). A training process after loading holds 1.75-1.94 GiB of RSS besides its pinned
# buffers in the grid's worker, and 2.09 GiB in `slimtune run` (the flow's process also runs Prefect).
_PROCESS_HOST_BYTES = int(2.15 * _GIB)
# Anonymous memory of the flow's process after training, before merge and export start: 1.38 GiB at 8B;
# the merge of the same model peaked at 3.89-4.36 GiB anonymous in four runs (shard buffer on top).
_PROCESS_ANON_BYTES = int(1.60 * _GIB)
# The caching allocator rounds blocks up and fragments, so reserved memory exceeds the tensors
# alive; load and merge estimates carry 10% on top of what they count.
_ALLOCATOR_SLACK = 0.10
# Held outside the caching allocator (context, cuBLAS, Triton modules; NVML per process less reserved), torch 2.11:
# 0.79-0.80 GiB training, 0.60 loading, H100 and H200 (h200-2026-11-28-context-probe.json; NVML v1 adds the driver's).
CUDA_CONTEXT_BYTES = int(0.82 * _GIB)
_LOAD_CONTEXT_BYTES = int(0.68 * _GIB)
# Anonymous host memory of the loading process: 0.64 GiB in a bare worker, 0.72 GiB inside the flow.
_LOAD_HOST_BYTES = int(0.73 * _GIB)
_CONTEXT_TERM = "CUDA context and libraries (outside the allocator)"
# Training: with expandable segments (slimtune.core.device) reserved stays close to allocated, and what remains
# grows with the step's short-lived tensors (the activation and loss terms). Measured reserved - allocated
# over the grid: 0.02-0.57 GiB with the fused kernels and standard checkpointing, up to 2.6 GiB at 4 x 8192
# with offloading (copies on a second stream keep their blocks apart), and up to 4.2 GiB with kernels off
# (eager ops leave many differently sized temporaries). These shares of those terms cover every cell.
_FRAGMENTATION = 0.15
_FRAGMENTATION_OFFLOADED = 0.25
_FRAGMENTATION_EAGER = 0.36
# With the fused kernels (SwiGLU, RMSNorm, RoPE, LoRA over NF4) a layer keeps less than the eager
# count of `activations.bytes_per_token_layer`: measured slope / counted, over 1B, 8B and Qwen 7B:
# 0.645-0.665 of it stored without checkpointing, 0.79-0.905 while one layer is recomputed.
_FUSED_ACTIVATION_KERNELS = frozenset({"lora_nf4", "rms_norm"})
_FUSED_STORED = 0.68
_FUSED_RECOMPUTE = 0.9
# A floor under the fragmentation share, a term of its own: the tensors' terms count up to 0.14 GiB short of the peak
# allocated plus context in 15 of the 46 cells (mb 1 most: Qwen2.5-7B 1 x 2048), so a tight fit
# (`Estimate.runs_in`) gives up the share alone and keeps this (tests/test_memory_calibration.py holds both).
_FRAGMENTATION_FLOOR = int(0.2 * _GIB)
_FLOOR_TERM = "allocator rounding and small tensors (floor)"
# With the input table in host memory, reserved - allocated runs above the tied 1B's at the same tokens
# (8B at 4 x 2048: 0.57 vs 0.02 GiB offloaded; 0.25-0.41 vs 0.06-0.16 GiB with standard checkpointing).
# Measured, not yet explained: a quarter of the table covers it.
_HOST_TABLE_FRAGMENTATION = 0.25
# Offloaded checkpointing: layer inputs on the GPU at once (the one computed, copies to and from host).
_OFFLOAD_IN_FLIGHT = 3
# Share of the stored layers' freed blocks that the first recomputed layer reuses. On an H200, 8B at 16 x 2048 with
# one stored layer (5.2 GiB of activations) and CUDA graphs held 22.47 GiB of the card, where full reuse estimated
# 22.03: at most 0.91 of it was reused. In each of the 9 runs of that call and the next
# (benchmarks/results/memory/h200-2026-11-27-stored-layers{,-b}.json) the forward (`_FORWARD_TERM`) or the loss is now
# the larger phase (1.088-1.148 x measured), so they no longer bound this share.
_STORED_REUSED = 0.75
_STORED_TERMS = ("activations (no checkpointing)", "activations of the stored layers", "checkpointed layer inputs")
_WEIGHT_TERMS = ("nf4 linears", "embeddings and lm_head", "norms and biases")
_STATE_TERMS = ("lora weights and grads (fp32)", "optimizer state", _CONTEXT_TERM)
# Offloading frees each layer input in the forward while its copy to host is still queued (`ActivationOffloader.save`
# records it on the side stream): its block is reused only once the copy ran, and the host runs ahead of the GPU, so up
# to every recomputed layer's input is held at once. The 8B offloaded cells of the 2026-11-23 table peak there: 3.3-3.6
# hidden states above the resident weights and every layer input at 1-4 x 8192. Eagerly the recompute reuses those
# blocks (the offloaded share covers them); under CUDA graphs it runs in their private pool, which cannot.
_FORWARD_HIDDEN_STATES = 4
_FORWARD_TERM = "layer inputs awaiting their copy to host (peak phase: the forward)"
# The graphs' private pool: what a layer's recompute and backward allocate inside the capture. The graphed cells of
# benchmarks/results/memory/h100-2026-11-24{c,e}-graphs.json reserved 0.84-1.00 of the recomputed layer over the
# eager cell's peak at 1B (its recompute), 0.77-1.18 at 8B (its forward and the static buffers; device-used moves by
# up to 0.55 GiB between the calls). At 0.9 every graphed cell estimates 1.006-1.113 x measured (8B 1 x 8192 of the
# second call, 1B 4 x 8192); with the pool on top of the recompute alone, 1.002-1.204.
_GRAPH_POOL = 0.9
# allocated once per run, and the private pool is no block of the allocator's to fragment
_GRAPH_TERMS = ("CUDA graphs: static inputs and LoRA gradients", "CUDA graphs: private pool (one recomputed layer)")
# bitsandbytes 4-bit blocks: 64 weights share one absmax; with double quantisation 256 absmax
# values share one float32 second-level absmax, and each layer keeps a 256-entry float32 code.
_NF4_BLOCK = 64
_NESTED_BLOCK = 256

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _nf4_bytes(n: int, double_quant: bool) -> int:
    """Bytes bitsandbytes stores for one 4-bit linear of `n` weights (packed data + quant state)."""
    blocks = math.ceil(n / _NF4_BLOCK)
    code = 16 * 4  # the NF4 lookup table, float32
    if not double_quant:
        return n // 2 + blocks * 4 + code
    nested = math.ceil(blocks / _NESTED_BLOCK)
    return n // 2 + blocks + nested * 4 + _NESTED_BLOCK * 4 + code


def _nf4_weights(shape: ModelShape, dtype_bytes: int, double_quant: bool) -> dict[str, int]:
    layers = sum(
        _nf4_bytes(a * b, double_quant) * shape.copies(n) for layer in shape.each_layer() for n, (a, b) in layer.items()
    )
    return {
        "nf4 linears": layers + (_nf4_bytes(shape.other_linears, double_quant) if shape.other_linears else 0),
        "embeddings and lm_head": shape.embedding_weights() * dtype_bytes,
        "norms and biases": shape.small_weights() * dtype_bytes,
    }


def _with_slack(terms: dict[str, int]) -> dict[str, int]:
    return {**terms, "allocator slack": int(sum(terms.values()) * _ALLOCATOR_SLACK)}


def _prefixed(prefix: str, terms: dict[str, int]) -> dict[str, int]:
    return {f"{prefix}{k}": v for k, v in terms.items()}


def _estimate(
    gpu: dict[str, int], host: dict[str, int], disk: dict[str, int], fields: dict[str, str], resident: int = 0
) -> Estimate:
    return Estimate(
        gpu_bytes=sum(gpu.values()),
        resident_gpu_bytes=resident,
        context_gpu_bytes=gpu.get(_CONTEXT_TERM, 0),
        host_bytes=sum(host.values()),
        disk_bytes=sum(disk.values()),
        breakdown={**_prefixed("gpu: ", gpu), **_prefixed("host: ", host), **_prefixed("disk: ", disk)},
        fields=fields,
    )


def estimate_load_4bit(
    cfg: dict[str, Any], compute_dtype_bytes: int, *, double_quant: bool = True, host_tables: bool = False
) -> Estimate:
    """Memory to hold the model in NF4 with 16-bit embeddings, lm_head and norms.

    `host_tables`: the untied input table and lm_head are read straight into pinned host memory
    (`slimtune.tasks.load_tables`, where training streams the head).

    Llama-3.1-8B: 224 linears of 6.98e9 weights at 0.516 bytes (3.60 GB) plus 2 x 1.05 GB of
    bf16 embeddings/lm_head = 5.7 GB. Loading quantises one tensor at a time on the GPU, so the
    transient is one 16-bit linear (measured: the allocator peak is the weights to 0.1%). The host
    maps the safetensors shards (file-backed pages the kernel can drop; 15 GiB of RSS for 8B) and
    holds only the process itself in anonymous memory (0.64-0.72 GiB measured for 1B, 7B and 8B).
    A mixture of experts' 3-D experts are read and quantized one layer at a time (`slimtune.tasks.load_experts`):
    Qwen3-30B-A3B's shape cut to 6 layers peaked at 5.15 GiB allocated on an H200 (5.21 GiB counted here without
    the context; 9.32 GiB when every layer's experts were loaded in 16 bits first).
    """
    shape = model_shape(cfg)
    gpu = _nf4_weights(shape, compute_dtype_bytes, double_quant)
    gpu["load transient (one 16-bit linear)"] = (
        max(a * b for a, b in shape.projections().values()) * compute_dtype_bytes
    )
    if shape.experts:  # bitsandbytes leaves 3-D experts alone: load_4bit reads and quantizes them layer by layer
        from slimtune.kernels.nf4_experts import CHUNK_ELEMENTS

        matrices = [a * b for n, (a, b) in shape.projections().items() if shape.copies(n) > 1]
        gpu["load transient (one layer's experts in 16 bits until quantized)"] = (
            sum(matrices) * shape.experts * compute_dtype_bytes
        )
        # Quantizing holds up to ~18 bytes of fp32/int32 temporaries per weight of one chunk of whole experts,
        # measured on an H200 in bf16 beside the layer's 16-bit experts and their NF4: 1.06 GiB for a Qwen3-30B-A3B
        # layer (chunks of 42 experts of 768 x 2048), 1.05 GiB for 128 experts of 1536 x 4096 (chunks of 10),
        # 0.31 GiB for 16 experts of 768 x 2048 (one chunk).
        chunk = max(min(shape.experts, max(1, CHUNK_ELEMENTS // m)) * m for m in matrices)
        gpu["load transient (quantizing a chunk of experts)"] = 18 * chunk
    gpu[_CONTEXT_TERM] = _LOAD_CONTEXT_BYTES
    host = {"process (anonymous memory; shards are mapped)": _LOAD_HOST_BYTES}
    if host_tables and not shape.tied:
        tables, gpu["embeddings and lm_head"] = gpu["embeddings and lm_head"], 0
        # pinned, and each table is read through an unpinned buffer of its size before the copy
        host["input table and lm_head (pinned) and one table read"] = tables + tables // 2
    fields = {
        "gpu": "model.name (a smaller model) or the budget fraction",
        "host": "host memory (a larger machine)",
    }
    return _estimate(gpu, host, {}, fields)


def _targets(shape: ModelShape, target_modules: list[str] | tuple[str, ...] | str) -> list[str]:
    projections = shape.projections()
    if target_modules == "all-linear":
        return list(projections)
    if not isinstance(target_modules, str):  # fused names (Phi-3 qkv_proj) count as their parts
        target_modules = canonical_targets(shape.model_type, list(target_modules))
    unknown = [t for t in target_modules if t not in projections]
    if unknown or isinstance(target_modules, str):
        raise ValueError(
            f"lora.target_modules is {target_modules!r}, which these estimates do not know; "
            f"use names from {list(_PROJECTIONS)} or 'all-linear'"
        )
    return list(dict.fromkeys(target_modules))


def estimate_train(
    cfg: dict[str, Any],
    *,
    micro_batch: int,
    seq_len: int,
    lora_r: int,
    target_modules: list[str] | tuple[str, ...] | str,
    checkpointing: bool | str,
    optimizer_bytes_per_param: int = 8,
    kernels: Collection[str] = (),
    compute_dtype_bytes: int = 2,
    double_quant: bool = True,
    on_gpu: bool = True,
    shard_ranks: int = 1,
    varlen_attention: bool = False,
    cuda_graphs: bool = False,
    stored_layers: int = 0,
) -> Estimate:
    """Memory for one QLoRA training step at `micro_batch` x `seq_len` tokens, device-wide (per rank).

    `checkpointing`: False keeps every layer's activations; True (or "standard") keeps each
    layer's input and recomputes one layer at a time; "unsloth"/"offload" moves the layer inputs
    to pinned host memory. `kernels` names the kernels `apply_kernels` will apply
    (`expected_kernels`): "fused_linear_ce" never materialises full logits, and the fused
    activation kernels keep less per layer. LoRA weights and gradients are float32;
    `optimizer_bytes_per_param` is 8 for AdamW's two float32 moments, 2 for 8-bit.

    The step peaks either at the loss (every stored activation plus the logits and their gradient)
    or while one layer is recomputed in backward, never at both: the estimate takes the larger.
    The weights are in `resident_gpu_bytes` (load_4bit put them there), so preflight counts them
    once. Calibrated on an H100 (benchmarks/results/memory/, tests/test_memory_calibration.py).

    `varlen_attention`: packed rows go through varlen flash attention (`slimtune.train.step.attention`); with
    the RoPE kernel a layer then keeps one more q, k and v.

    `cuda_graphs`: `train.cuda_graphs` will capture each layer's backward (`slimtune.train.step.layer_graphs`, with
    "unsloth" checkpointing): its static buffers (three hidden states: two layer inputs and a gradient; one set of
    LoRA gradients), which the offloader brings the inputs back into (no layer inputs in flight beside them), and its
    private pool, which holds most of one recomputed layer apart from the allocator's other blocks. The pool cannot
    reuse what the forward held back (layer inputs whose copy to host was still queued), so under graphs that is a
    peak phase of its own. Calibrated on an H100 (`benchmarks/results/memory/h100-2026-11-24{c,e}-graphs.json`,
    tests/test_memory_calibration.py).

    `stored_layers`: under checkpointing, the last this many decoder layers keep their activations instead of
    recomputing them (`train.stored_layers`). Their backward runs first and frees those activations before any
    layer is recomputed, and the recompute reuses most of their blocks, not all (`_STORED_REUSED`): the step peaks
    at the larger of (stored activations + loss) and (what the recompute cannot reuse + one recomputed layer).

    `shard_ranks` > 1 is FSDP-QLoRA: each rank keeps 1/shard_ranks of the weights, LoRA weights, grads
    and optimizer state, and gathers whole layers while it computes them (the one it computes and the
    one prefetched: two decoder layers' NF4 weights). Activations are per rank, as under DDP. Each rank
    quantizes the model in host memory and FSDP moves it to the GPU unit by unit as it wraps
    (load_4bit.loads_on_host), so a rank never holds the whole model. Wrapping peaks at the root unit,
    wrapped last: its tables and their flat copy beside the layers' shards, below the step's gathered root,
    its shard and their fragmentation (tests/test_fsdp.py checks it). FSDP shards the
    packed NF4 data; each linear's quantization state (a module attribute) stays whole on every rank. Not
    calibrated on a GPU yet.
    """
    shape = model_shape(cfg)
    tokens = micro_batch * seq_len
    gpu = _nf4_weights(shape, compute_dtype_bytes, double_quant)
    if shard_ranks > 1:
        unsharded = gpu
        gpu = {k: -(-v // shard_ranks) for k, v in gpu.items()}
        packed = shape.layers * sum(a * b // 2 * shape.copies(n) for n, (a, b) in shape.projections().items())
        gpu["nf4 linears"] = -(-packed // shard_ranks) + unsharded["nf4 linears"] - packed
        layer = sum(_nf4_bytes(a * b, double_quant) * shape.copies(n) for n, (a, b) in shape.projections().items())
        gpu["gathered layers (FSDP: computing and prefetched)"] = 2 * layer
        # The root unit (input table, lm_head, final norm) is gathered for the forward and, being the root,
        # FSDP1 keeps it gathered until its backward: the whole tables for the step, beside the shard.
        gpu["gathered root unit (FSDP: embeddings and lm_head)"] = unsharded["embeddings and lm_head"]
    # attach_lora moved the frozen input table to pinned host memory and training leaves it there (8B:
    # allocated 5.32 -> 4.49 GiB at attach, measured); resident is what stays on the GPU.
    host_table = host_head = 0
    if "host_embedding" in kernels and not shape.tied:
        host_table = shape.vocab * shape.hidden * compute_dtype_bytes
    if "host_lm_head" in kernels and "fused_linear_ce" in kernels and not shape.tied:
        host_head = shape.vocab * shape.hidden * compute_dtype_bytes  # streamed from pinned host memory by the loss
    gpu["embeddings and lm_head"] -= host_table + host_head
    resident = sum(gpu.values())
    targets = _targets(shape, target_modules)
    lora = sum(
        lora_r * (layer[t][0] + layer[t][1]) * shape.copies(t)
        for layer in shape.each_layer()
        for t in targets
        if t in layer
    )
    gpu["lora weights and grads (fp32)"] = -(-lora * 8 // shard_ranks)
    gpu["optimizer state"] = -(-lora * optimizer_bytes_per_param // shard_ranks)

    fused = _FUSED_ACTIVATION_KERNELS <= set(kernels)
    per_layer = bytes_per_token_layer(shape, compute_dtype_bytes, targets, lora_r)
    if shape.linear_attention:
        per_layer = int(per_layer * LINEAR_ATTENTION_ACTIVATIONS)
    varlen = varlen_bytes_per_token_layer(shape, compute_dtype_bytes) if varlen_attention and "rope" in kernels else 0
    scores = eager_scores_bytes_per_token_layer(shape, seq_len, compute_dtype_bytes)
    layer_input = shape.hidden * compute_dtype_bytes
    host = {"process and CUDA libraries": _PROCESS_HOST_BYTES}
    mode = "standard" if checkpointing is True else (checkpointing or "none")
    recompute = stored = forward = 0
    stored_per_layer = int(tokens * (per_layer * (_FUSED_STORED if fused else 1.0) + varlen + scores))
    if mode == "none":
        gpu["activations (no checkpointing)"] = stored_per_layer * shape.layers
    elif mode in ("standard", "unsloth", "offload"):
        if not 0 <= stored_layers <= shape.layers:
            raise ValueError(f"train.stored_layers is {stored_layers}: the model has {shape.layers} decoder layers")
        recomputed = shape.layers - stored_layers
        if stored_layers:
            stored = gpu["activations of the stored layers"] = stored_per_layer * stored_layers
        if recomputed:
            recompute = int(
                tokens * (per_layer * (_FUSED_RECOMPUTE if fused else 1.0) + varlen + EAGER_SCORES_RECOMPUTE * scores)
            )
        if mode == "standard" and recomputed:
            gpu["checkpointed layer inputs"] = tokens * recomputed * layer_input
        elif recomputed:
            if cuda_graphs and on_gpu:
                # The backward's inputs come back into the graphs' static buffers, which stand in for those in flight.
                layer_lora = -(-lora // shape.layers)
                gpu[_GRAPH_TERMS[0]] = 3 * tokens * layer_input + layer_lora * 4
                gpu[_GRAPH_TERMS[1]] = int(_GRAPH_POOL * recompute)
                # the stored layers run last in the forward: their activations stand in for the layer computing
                layer_states = max(tokens * _FORWARD_HIDDEN_STATES * layer_input - stored, 0)
                forward = tokens * recomputed * layer_input + layer_states
            else:
                # Layer inputs stay on the GPU while copies to and from host overlap with compute.
                gpu["layer inputs in flight"] = tokens * _OFFLOAD_IN_FLIGHT * layer_input
            host["offloaded layer inputs (pinned)"] = tokens * recomputed * layer_input
    else:
        raise ValueError(f"lora.gradient_checkpointing is {checkpointing!r}; use false, true, 'standard' or 'unsloth'")

    if shape.experts:
        from slimtune.kernels.nf4_experts import DEQUANT_CHUNK_BYTES

        # The grouped expert matmuls dequantize a chunk of experts at a time, in forward, recompute and backward:
        # gate_up's chunk (the wider) at most, twice while Qwen3-MoE's separately stored gate and up are stacked
        # (gpt-oss's fused gate_up needs it once: counted twice there too, 256 MiB on the safe side, not measured).
        per_expert = 2 * shape.hidden * shape.intermediate * compute_dtype_bytes
        chunk = min(shape.experts, max(1, DEQUANT_CHUNK_BYTES // per_expert)) * per_expert
        gpu["a chunk of experts dequantized (grouped matmul)"] = 2 * chunk
    if host_table:
        host["input embeddings (pinned)"] = host_table
    if host_head:
        from slimtune.kernels.host_lm_head import head_chunk_rows

        host["lm_head (pinned)"] = host_head
        # Two chunks of the head (one computing, one arriving), one chunk of logits, and per token and hidden unit
        # the float32 d(hidden) accumulator and three 16-bit buffers: a chunk's product, the label rows, the gradient.
        rows = head_chunk_rows(tokens, shape.vocab, shape.hidden, compute_dtype_bytes)
        loss = (2 * shape.hidden + tokens) * rows * compute_dtype_bytes + tokens * shape.hidden * (4 + 3 * 2)
    elif "fused_linear_ce" in kernels:
        # One chunk of logits (the kernel's cap) and the float32 gradient of the last hidden state. Imported here:
        # the kernel module imports Triton, which an estimate without that kernel never needs.
        from slimtune.kernels.fused_linear_ce import CHUNK_BYTES_CAP

        loss = min(tokens * shape.vocab * compute_dtype_bytes, CHUNK_BYTES_CAP) + tokens * shape.hidden * 4
    else:
        # The bf16 lm_head output, its float32 upcast in the loss, the saved log-softmax and its
        # float32 gradient (2 + 4 + 4 + 4 bytes, less the upcast freed before the gradient = 12).
        loss = tokens * shape.vocab * 12
    # Under graphs the offloaded share's copies are counted as they are: the forward's as its own phase, the backward's
    # land in the static buffers.
    offloaded = mode in ("unsloth", "offload") and _GRAPH_TERMS[1] not in gpu
    share = _FRAGMENTATION_EAGER if not fused else _FRAGMENTATION_OFFLOADED if offloaded else _FRAGMENTATION
    reused = stored - int(stored * (1 - _STORED_REUSED))  # by the recompute, once the stored layers' backward ran
    if stored + loss >= stored - reused + recompute:
        phase, value, reused = "logits and loss (peak phase)", loss, 0
    elif stored:
        phase, value = "one recomputed layer, less the stored blocks it reuses (peak phase)", recompute - reused
    else:
        phase, value = "one recomputed layer (peak phase)", recompute
    if forward > value + (value + reused) * share:  # its held blocks are its fragmentation
        phase, value, reused = _FORWARD_TERM, forward, 0
    gpu[phase] = value
    # Stored activations are allocated once per step; what is freed and re-allocated within the
    # step (layer inputs in flight, the peak phase: a whole recomputed layer) is what fragments the allocator's blocks.
    churn = reused + sum(
        v
        for k, v in gpu.items()
        if k not in _STATE_TERMS + _WEIGHT_TERMS + _STORED_TERMS + _GRAPH_TERMS + (_FORWARD_TERM,)
    )
    gpu[FRAGMENTATION_TERM] = int(churn * share) + int(host_table * _HOST_TABLE_FRAGMENTATION)
    gpu[_FLOOR_TERM] = _FRAGMENTATION_FLOOR
    if on_gpu:
        gpu[_CONTEXT_TERM] = CUDA_CONTEXT_BYTES
    checkpoint = lora * (4 + optimizer_bytes_per_param)
    # A resumable checkpoint is written beside the previous one before that one is removed.
    disk = {"adapter and optimizer checkpoints (2 kept while writing)": 2 * checkpoint}
    step_fields = (
        "train.micro_batch_size (with train.gradient_accumulation_steps), data.max_seq_length, "
        "train.stored_layers or lora.gradient_checkpointing"
    )
    adapters = gpu["lora weights and grads (fp32)"] + gpu["optimizer state"]
    if adapters > sum(v for k, v in gpu.items() if k not in _STATE_TERMS + _WEIGHT_TERMS):
        # More in the adapters than in the step (LoRA on every expert of an MoE): the micro-batch cannot buy it back
        adam = "" if optimizer_bytes_per_param <= 2 else ", train.optimizer paged_adamw_8bit (2 bytes per parameter)"
        step_fields = f"lora.r or lora.target_modules (the adapters and their optimizer state){adam}; {step_fields}"
    fields = {
        "gpu": step_fields,
        "host": "lora.gradient_checkpointing (offloading keeps layer inputs in host memory)",
        "disk": "output_dir (a disk with more space)",
    }
    return _estimate(gpu, host, disk, fields, resident=resident)


def estimate_merge(
    cfg: dict[str, Any], *, max_shard_bytes: int, output_dtype_bytes: int, copied_bytes: int = 0
) -> Estimate:
    """Memory for a layer-by-layer dequantise + merge that writes `max_shard_bytes` shards.

    The GPU holds one decoder layer dequantised in the output dtype and the largest matrix in
    float32 for the `addmm_` of the LoRA update; host memory buffers one shard before it is
    written; disk receives the whole model in the output dtype, and `copied_bytes` of weights the merge
    copies as they are stored (a multimodal checkpoint's vision tower, projector and Qwen3.5's `mtp.*`).
    """
    shape = model_shape(cfg)
    largest = max(a * b for a, b in shape.projections().values())
    gpu = _with_slack(
        {
            "one layer dequantised": shape.linear_weights_per_layer() * output_dtype_bytes,
            "largest matrix in fp32 for the merge": largest * 4,
        }
    )
    gpu[_CONTEXT_TERM] = CUDA_CONTEXT_BYTES
    full = shape.total_weights() * output_dtype_bytes
    host = {
        "process (anonymous memory; shards are mapped)": _PROCESS_ANON_BYTES,
        "one shard buffered": min(max_shard_bytes, full),
        "largest tensor in output dtype": shape.vocab * shape.hidden * output_dtype_bytes,
    }
    disk = {"merged model": full}
    if copied_bytes:
        disk["weights copied as stored (vision tower, projector, mtp)"] = copied_bytes
    fields = {
        "gpu": "merge.maximum_memory_usage",
        "host": "merge.max_shard_size_gb or merge.maximum_memory_usage",
        "disk": "output_dir or merge.temporary_location (a disk with more space)",
    }
    return _estimate(gpu, host, disk, fields)


def estimate_export(cfg: dict[str, Any], *, out_types: list[str] | tuple[str, ...]) -> Estimate:
    """Disk and host memory to write GGUF files of `out_types` and load them to verify.

    K-quants are made from an f16 GGUF, so that intermediate file counts too. The converter holds one
    tensor in float32 and its converted copy; llama.cpp maps the file it verifies (file-backed pages,
    not counted). Measured at 8B f16: 4.40 GiB anonymous peak, merge's leftovers included.
    """
    shape = model_shape(cfg)
    unknown = [t for t in out_types if t.lower() not in GGUF_TYPES]
    if unknown:
        raise ValueError(f"export.gguf has {unknown}; supported: {sorted(GGUF_TYPES)}")
    weights = shape.total_weights()
    sizes = {t.lower(): int(weights * GGUF_TYPES[t.lower()].bytes_per_weight) for t in out_types}
    disk = {f"{t}.gguf": size for t, size in sizes.items()}
    if any(GGUF_TYPES[t].needs_f16_intermediate for t in sizes) and "f16" not in sizes:
        disk["f16 intermediate for k-quants"] = weights * 2
    host = {
        "process (anonymous memory; files are mapped)": _PROCESS_ANON_BYTES,
        "one tensor in fp32": shape.vocab * shape.hidden * 4,
        "its converted copy (16-bit)": shape.vocab * shape.hidden * 2,
    }
    fields = {
        "host": "export.gguf (verify fewer or smaller types)",
        "disk": "export.gguf or output_dir",
    }
    return _estimate({}, host, disk, fields)
