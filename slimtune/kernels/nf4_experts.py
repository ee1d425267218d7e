"""NF4 storage for fused 3-D mixture-of-experts weights, and an experts module that trains LoRA on it.

transformers 5 stores experts as one 3-D parameter per projection (`Qwen3MoeExperts.gate_up_proj`
[E, 2*I, H]); bitsandbytes quantizes 2-D linears only (bitsandbytes#1849), so Qwen3-30B-A3B would stay
at ~61 GB of bf16. Here each expert matrix is quantized to NF4 with double quantization (blocksize 64),
byte-for-byte what `bitsandbytes.functional.quantize_4bit(w[e], "nf4", compress_statistics=True)`
gives, but stacked: one tensor per field for all experts, so a layer holds six tensors, not 2*E
`QuantState`s. `quant_state(e)` hands bitsandbytes (or `slimtune.kernels.nf4.dequantize_nf4`) views
of one expert.

`NF4Experts` replaces `Qwen3MoeExperts` or `GptOssExperts` with the same forward signature and the
same routing. A layer's routed tokens are sorted by expert once, and each projection runs as grouped
GEMMs (`grouped_matmul`: one `torch._grouped_mm` per chunk of experts) over weights dequantized a chunk of
experts at a time (`DEQUANT_CHUNK_BYTES`), the LoRA factors as grouped GEMMs of their own. Run one expert at
a time, the ~25 ops of each expert's projections took Qwen3-30B-A3B's 128 experts x 48 layers to ~10 s a
step, almost all of it launches. `_NF4GroupedMatmul` dequantizes again in backward instead of saving the
weights: saving them would keep every layer's dense experts (~1.5 GiB per Qwen3-30B-A3B layer in bf16)
alive until backward, which is the memory NF4 was meant to save.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from bitsandbytes.functional import QuantState, create_dynamic_map, get_4bit_type
from torch import nn

from slimtune.models.experts import EXPERT_CLASSES, HELD, per_expert_lora_key, stored_projections

BLOCKSIZE = 64  # NF4 block, as bitsandbytes' default and QLoRA's
_BLOCKSIZE2 = 256  # blocks of absmax values that bitsandbytes' double quantization uses
CHUNK_ELEMENTS = 1 << 26  # fp32 temporaries of quantization bounded to ~256 MiB per chunk of experts
# Dense experts one grouped GEMM reads, dequantized at once (a Qwen3-30B-A3B layer's 128 gate_up matrices are
# 768 MiB in bf16): a few chunks a projection keep the launches few and the transient bounded
DEQUANT_CHUNK_BYTES = 256 << 20
LORA_PROJECTIONS = tuple(HELD)  # the projections of `NF4Experts`: gate_up, down


class NF4ExpertWeights(nn.Module):
    """E matrices of one shape in NF4 with double quantization, one stacked buffer per field.

    Buffers: `packed` [E, out*in/2] uint8 (high nibble = even element), `absmax` [E, n_blocks] uint8
    (8-bit absmax codes), `absmax2` [E, ceil(n_blocks/256)] fp32, `offset` [E] fp32, and the two code
    books shared by all experts, `code` [16] (NF4) and `code2` [256] (bitsandbytes' dynamic map).
    """

    def __init__(
        self, num_experts: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        numel = shape[0] * shape[1]
        if numel % BLOCKSIZE:
            raise ValueError(f"expert matrix {shape} has {numel} elements, not a multiple of the NF4 block {BLOCKSIZE}")
        n_blocks = numel // BLOCKSIZE
        self.shape = shape
        self.dtype = dtype
        self.register_buffer("packed", torch.empty(num_experts, numel // 2, dtype=torch.uint8, device=device))
        self.register_buffer("absmax", torch.empty(num_experts, n_blocks, dtype=torch.uint8, device=device))
        self.register_buffer("absmax2", torch.empty(num_experts, -(-n_blocks // _BLOCKSIZE2), device=device))
        self.register_buffer("offset", torch.empty(num_experts, device=device))
        self.register_buffer("code", get_4bit_type("nf4", device=device))
        self.register_buffer("code2", create_dynamic_map().to(device))

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    def quant_state(self, e: int, dtype: torch.dtype | None = None) -> QuantState:
        """Expert `e` as bitsandbytes' `QuantState` (views of the stacked buffers, no copies), dequantizing to
        `dtype` (default the quantized weight's)."""
        state2 = QuantState(absmax=self.absmax2[e], code=self.code2, blocksize=_BLOCKSIZE2, dtype=torch.float32)
        return QuantState(
            absmax=self.absmax[e],
            shape=torch.Size(self.shape),
            code=self.code,
            blocksize=BLOCKSIZE,
            quant_type="nf4",
            dtype=dtype or self.dtype,
            offset=self.offset[e],
            state2=state2,
        )

    def dequantize_experts(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Experts `start:stop` as [n, *shape] in `dtype` (default the quantized weight's), each equal to bitsandbytes'
        `dequantize_4bit` of that expert.

        Same arithmetic and roundings as bitsandbytes: absmax = fp32(code2[q] * absmax2) + offset (two roundings,
        here for the whole chunk of experts, each with its own offset), then fp32(code[nibble] * absmax) rounded once
        to `dtype`: on CUDA by bitsandbytes' own kernel, for all the experts in one launch; elsewhere by torch ops
        (bitsandbytes' AVX-512 CPU kernel gives other values where a row is not a whole number of blocks).
        """
        n, n_blocks = stop - start, self.absmax.shape[1]
        dtype = dtype or self.dtype
        absmax2 = self.absmax2[start:stop].repeat_interleave(_BLOCKSIZE2, dim=1)[:, :n_blocks]
        absmax = self.code2[self.absmax[start:stop].long()] * absmax2 + self.offset[start:stop, None]
        packed = self.packed[start:stop]
        if packed.is_cuda:
            flat = torch.ops.bitsandbytes.dequantize_4bit.default(
                packed.reshape(-1, 1), absmax.view(-1), BLOCKSIZE, "nf4", [n * self.shape[0], self.shape[1]], dtype
            )
            return flat.view(n, *self.shape)
        nibbles = torch.stack((packed >> 4, packed & 15), dim=-1).view(n, n_blocks, BLOCKSIZE).long()
        return (self.code[nibbles] * absmax.unsqueeze(-1)).view(n, *self.shape).to(dtype)


def quantize_experts(weight: torch.Tensor, dtype: torch.dtype | None = None) -> NF4ExpertWeights:
    """NF4 with double quantization of each `weight[e]` ([E, out, in]), stacked.

    Byte-for-byte `bitsandbytes.functional.quantize_4bit(weight[e], quant_type="nf4",
    compress_statistics=True, blocksize=64)`: the 4-bit step is bitsandbytes' own torch formula
    (`backends/default/ops.py`) applied to a chunk of experts at once; the absmax statistics of all
    experts go through bitsandbytes' `quantize_blockwise` op in one call, each expert's row padded with
    zeros to whole blocks of 256 (a zero never raises a block's max, so no expert's codes change).

    Args:
        weight: the fused expert parameter, float32/bf16/fp16, any device.
        dtype: the dtype `dequantize` returns by default (the compute dtype); default `weight.dtype`.
    """
    if weight.dim() != 3:
        raise ValueError(f"quantize_experts expects a 3-D [experts, out, in] tensor, got shape {tuple(weight.shape)}")
    num_experts, rows, cols = weight.shape
    storage = NF4ExpertWeights(num_experts, (rows, cols), dtype or weight.dtype, weight.device)
    bounds = (storage.code[:-1] + storage.code[1:]) / 2  # NF4's code is sorted: midpoints bucket to nearest
    absmax = torch.empty(num_experts, storage.absmax.shape[1], device=weight.device)
    chunk = max(1, CHUNK_ELEMENTS // (rows * cols))
    for start in range(0, num_experts, chunk):
        blocks = weight[start : start + chunk].reshape(-1, BLOCKSIZE).float()
        block_max = blocks.abs().max(dim=-1)[0]
        scaled = torch.clamp(blocks * (1.0 / block_max.clamp(min=1e-38).unsqueeze(1)), -1, 1)
        q = torch.bucketize(scaled.view(-1), bounds, out_int32=True).to(torch.uint8)
        storage.packed[start : start + chunk] = ((q[::2] << 4) | q[1::2]).view(-1, rows * cols // 2)
        absmax[start : start + chunk] = block_max.view(-1, absmax.shape[1])
    for e in range(num_experts):  # per expert: a batched row mean may sum in another order than bnb's
        storage.offset[e] = absmax[e].mean()
    padded = F.pad(absmax - storage.offset.unsqueeze(1), (0, storage.absmax2.shape[1] * _BLOCKSIZE2 - absmax.shape[1]))
    codes, absmax2 = torch.ops.bitsandbytes.quantize_blockwise.default(padded, storage.code2, _BLOCKSIZE2)
    storage.absmax.copy_(codes[:, : absmax.shape[1]])
    storage.absmax2.copy_(absmax2.view(num_experts, -1))
    return storage


class NF4ExpertRows(nn.Module):
    """A fused projection whose row blocks the checkpoint stores as separate matrices (Qwen3-MoE's gate_up: each
    expert's gate_proj, then its up_proj), each block quantized on its own as bitsandbytes quantizes that stored
    matrix. Double quantization shifts a matrix's absmax by its own mean, so quantizing the fused rows would
    not be the NF4 of either stored matrix; this way the merge's NF4 round trip of each stored tensor
    (`slimtune.merge.nf4.roundtrip`) gives exactly the weights training used."""

    def __init__(self, parts: list[NF4ExpertWeights]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.dtype = parts[0].dtype

    @property
    def num_experts(self) -> int:
        return self.parts[0].num_experts

    @property
    def packed(self) -> torch.Tensor:  # the device and the first part's bytes, as NF4ExpertWeights has them
        return self.parts[0].packed

    def dequantize_experts(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Experts `start:stop`' fused matrices: each stored matrix's dequantization, stacked by rows."""
        return torch.cat([p.dequantize_experts(start, stop, dtype) for p in self.parts], dim=1)


class ExpertGroups(NamedTuple):
    """Rows sorted by expert: `counts[e]` rows of expert e after those of e - 1, and the same as device int32 ends
    (`torch._grouped_mm`'s offsets, kept on the device so that no GEMM waits on a copy from the host)."""

    counts: list[int]
    ends: torch.Tensor

    def chunk(self, start: int, stop: int) -> tuple[int, ExpertGroups]:
        """The first row of experts `start:stop`, and their groups counted from it."""
        first = sum(self.counts[:start])
        return first, ExpertGroups(self.counts[start:stop], self.ends[start:stop] - first)


def _grouped_mm_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands (`a` row-major): one dtype and every stride a multiple of 16
    bytes (LoRA ranks and widths that are not, e.g. r=4 in bf16, run a GEMM per expert)."""
    size = a.element_size()
    strides = (a.stride(0), *b.stride(), b.shape[-1])
    return a.dtype == b.dtype and all(s == 1 or s * size % 16 == 0 for s in strides)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """`a`'s rows of expert g times `b[g]` ([G, K, M]) for every g, as one grouped GEMM; differentiable. torch runs
    bf16 on sm90+ as one CUTLASS kernel and loops over the groups in C++ elsewhere (other GPUs, dtypes, the CPU)."""
    a = a.contiguous()
    if _grouped_mm_layout(a, b):
        return torch._grouped_mm(a, b, offs=groups.ends)
    return torch.cat([x @ w for x, w in zip(a.split(groups.counts), b)])


def _expert_chunks(weights: NF4ExpertWeights | NF4ExpertRows, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(start, stop) of the chunks of experts dequantized at once, each at most `DEQUANT_CHUNK_BYTES` dense."""
    rows, cols = weights.shape
    step = max(1, DEQUANT_CHUNK_BYTES // (rows * cols * dtype.itemsize))
    return [(e, min(e + step, weights.num_experts)) for e in range(0, weights.num_experts, step)]


def _nf4_grouped(
    x: torch.Tensor, weights: NF4ExpertWeights | NF4ExpertRows, groups: ExpertGroups, transposed: bool
) -> torch.Tensor:
    """Each expert's rows of `x` times its matrix W ([rows, cols]): `x @ W` if `transposed`, else `x @ W^T`."""
    out = []
    for start, stop in _expert_chunks(weights, x.dtype):
        first, chunk = groups.chunk(start, stop)
        rows = sum(chunk.counts)
        if not rows:
            continue
        w = weights.dequantize_experts(start, stop, x.dtype)
        out.append(grouped_matmul(x[first : first + rows], w if transposed else w.transpose(1, 2), chunk))
        del w  # before the next chunk is dequantized: one chunk at a time
    features = weights.shape[1] if transposed else weights.shape[0]
    return torch.cat(out) if out else x.new_zeros(0, features)


class _NF4GroupedMatmul(torch.autograd.Function):
    """`_nf4_grouped` with W constant, dequantized again in backward for the input gradient."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weights: NF4ExpertWeights | NF4ExpertRows, groups: ExpertGroups, transposed: bool
    ) -> torch.Tensor:
        ctx.weights, ctx.groups, ctx.transposed = weights, groups, transposed
        return _nf4_grouped(x, weights, groups, transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _nf4_grouped(grad, ctx.weights, ctx.groups, not ctx.transposed), None, None, None


def _swiglu_halves(act_fn: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's gate: `[gate | up]` halves, `act(gate) * up` (transformers' `_default_apply_gate`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


def _gpt_oss_gate(alpha: float, limit: float, gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate (`GptOssExperts._apply_gate`): interleaved gate/up, clamped, `(up + 1) * swish_alpha(gate)`."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class NF4Experts(nn.Module):
    """A drop-in for `Qwen3MoeExperts`/`GptOssExperts`: NF4 expert weights, optional LoRA per expert.

    LoRA (`add_lora`): per projection `<name>_lora_A` [E, r, in] (kaiming-uniform, as peft) and `<name>_lora_B`
    [E, out, r] (zeros), adding `(dropout(x) @ A_e^T) @ B_e^T * scale` to each routed token's projection.
    """

    def __init__(
        self,
        gate_up: NF4ExpertWeights | NF4ExpertRows,
        down: NF4ExpertWeights,
        gate_fn: Callable[[torch.Tensor], torch.Tensor],
        transposed: bool,
        biases: tuple[torch.Tensor, torch.Tensor] | None,
        stored: dict[str, tuple[str, ...]] = HELD,
    ) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = down
        self.gate_fn = gate_fn
        self.transposed = transposed
        self.num_experts = gate_up.num_experts
        self.stored = stored  # the names each projection's expert LoRA is saved under (`stored_projections`)
        if biases is not None:
            self.register_buffer("gate_up_bias", biases[0])
            self.register_buffer("down_bias", biases[1])
        else:
            self.gate_up_bias = self.down_bias = None
        self.lora_scale = 0.0

    @classmethod
    def from_experts(cls, module: nn.Module, compute_dtype: torch.dtype) -> NF4Experts:
        """Quantize a transformers experts module and drop its dense weights (`module` keeps none after)."""
        name = type(module).__name__
        if name == "Qwen3MoeExperts":
            gate_fn, transposed, biases = partial(_swiglu_halves, module.act_fn), False, None
        elif name == "GptOssExperts":
            gate_fn, transposed = partial(_gpt_oss_gate, module.alpha, module.limit), True
            biases = (
                module.gate_up_proj_bias.detach().to(compute_dtype),
                module.down_proj_bias.detach().to(compute_dtype),
            )
        else:
            raise TypeError(f"NF4Experts supports {', '.join(EXPERT_CLASSES)}, not {name}")
        fused = module.gate_up_proj.detach()
        if transposed:  # gpt-oss stores gate_up fused (interleaved columns), and is quantized as it is stored
            gate_up = quantize_experts(fused, compute_dtype)
        else:  # Qwen3-MoE's checkpoint stores gate_proj and up_proj apart (slimtune.models.experts)
            gate_up = NF4ExpertRows([quantize_experts(half, compute_dtype) for half in fused.chunk(2, dim=1)])
        down = quantize_experts(module.down_proj.detach(), compute_dtype)
        for param in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if hasattr(module, param):
                setattr(module, param, None)
        return cls(gate_up, down, gate_fn, transposed, biases, stored_projections(name))

    def _features(self, weights: NF4ExpertWeights | NF4ExpertRows) -> tuple[int, int]:
        """(in, out) of a projection, whichever way round its storage is."""
        rows, cols = weights.shape
        return (rows, cols) if self.transposed else (cols, rows)

    def add_lora(
        self,
        rank: int,
        scale: float,
        projections: Sequence[str] = LORA_PROJECTIONS,
        dropout: float = 0.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Trainable LoRA on `projections` of every expert, B zero so that the model starts unchanged.

        `scale` multiplies B A (peft's alpha / r, or alpha / sqrt(r) with rsLoRA); `dropout` acts on the LoRA
        input, as peft's. Saved per expert (`expert_lora_checkpoint`).
        """
        device = self.gate_up.packed.device
        for name in projections:
            n_in, n_out = self._features(getattr(self, name))
            lora_a = torch.empty(self.num_experts, rank, n_in, device=device, dtype=dtype)
            for a in lora_a:  # per expert, as peft's nn.Linear init of each adapter: bound = 1/sqrt(in)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            setattr(self, f"{name}_lora_A", nn.Parameter(lora_a))
            b = torch.zeros(self.num_experts, n_out, rank, device=device, dtype=dtype)
            setattr(self, f"{name}_lora_B", nn.Parameter(b))
        self.lora_scale = scale
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def remove_lora(self) -> None:
        """Back to the frozen experts alone (a retried attach_lora adds LoRA again)."""
        for name in LORA_PROJECTIONS:
            for half in ("A", "B"):
                if hasattr(self, f"{name}_lora_{half}"):
                    delattr(self, f"{name}_lora_{half}")
        self.lora_scale = 0.0

    def lora_projections(self) -> list[str]:
        """The projections that carry LoRA."""
        return [name for name in LORA_PROJECTIONS if hasattr(self, f"{name}_lora_A")]

    def _project(self, x: torch.Tensor, name: str, groups: ExpertGroups, experts: torch.Tensor) -> torch.Tensor:
        """One projection of the rows sorted by expert (`experts`: each row's): frozen NF4, + bias (gpt-oss), + LoRA.

        The LoRA factors are cast to the activation dtype for their grouped GEMMs, as the dense layers'
        (`slimtune.kernels.lora_linear`); their gradients reach the float32 parameters through the casts.
        """
        y = _NF4GroupedMatmul.apply(x, getattr(self, name), groups, self.transposed)
        bias = getattr(self, f"{name}_bias")
        if bias is not None:
            y = y + bias[experts]
        if hasattr(self, f"{name}_lora_A"):
            lora_a = getattr(self, f"{name}_lora_A").to(x.dtype).transpose(1, 2)  # [E, in, r]
            lora_b = getattr(self, f"{name}_lora_B").to(x.dtype).transpose(1, 2)  # [E, r, out]
            xa = grouped_matmul(self.lora_dropout(x), lora_a, groups)
            y = y + grouped_matmul(xa, lora_b, groups) * self.lora_scale
        return y

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """transformers' experts (`Qwen3MoeExperts.forward`): each routed (token, slot) through its expert, weighted,
        and each token's contributions added in expert order from zero as its per-expert `index_add_` adds them, so
        that the output is bitwise transformers' eager one on the dequantized weights (on the CPU) and deterministic
        on the GPU, where one `index_add_` of every row would race. One host sync per layer: the rows per expert."""
        tokens, top_k = top_k_index.shape
        with torch.no_grad():
            slots = top_k_index.t().reshape(-1)  # slot j = position * tokens + token
            order = torch.argsort(slots, stable=True)  # rows sorted by expert, as torch.where lists each expert's
            per_expert = torch.bincount(slots, minlength=self.num_experts)
            counts = per_expert.tolist()  # the layer's one host sync
            if len(counts) > self.num_experts:
                raise ValueError(f"the router chose expert {len(counts) - 1}; the layer has {self.num_experts}")
            groups = ExpertGroups(counts, per_expert.cumsum(0).to(torch.int32))
            experts, token_idx, position = slots[order], order % tokens, order // tokens
            row_of_slot = torch.empty_like(order)
            row_of_slot[order] = torch.arange(order.numel(), device=order.device)
            # [token, i]: the row of the token's i-th expert by index
            rows = row_of_slot.view(top_k, tokens).t().gather(1, top_k_index.argsort(dim=1, stable=True))
        x = hidden_states[token_idx]
        hidden = self.gate_fn(self._project(x, "gate_up", groups, experts))
        hidden = self._project(hidden, "down", groups, experts)
        hidden = (hidden * top_k_weights[token_idx, position, None]).to(hidden_states.dtype)[rows]
        final_hidden_states = torch.zeros_like(hidden_states)
        for i in range(top_k):
            final_hidden_states = final_hidden_states + hidden[:, i]
        return final_hidden_states


def expert_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every transformers experts module of `model`, in layer order.

    Dispatch is by class name, so neither transformers model module is imported here.
    """
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in EXPERT_CLASSES]


def quantize_model_experts(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every experts module of a model already in memory by `NF4Experts` in place; returns how many.

    load_4bit reads a checkpoint's experts from its shards instead (`slimtune.tasks.load_experts`); this is for models
    built in memory (the tests'). There is no undo: the dense weights are dropped as each layer is quantized.
    """
    targets = expert_blocks(model)
    for name, module in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, NF4Experts.from_experts(module, compute_dtype))
    return len(targets)


def expert_lora_checkpoint(model: nn.Module) -> dict[str, torch.Tensor]:
    """The experts' LoRA of `model` (a peft model) as peft would save LoRA on per-expert linears, under the
    checkpoint's names (`slimtune.models.experts`): gate_up's B split into gate and up rows and its A given to
    both (B_gate A and B_up A are exactly gate_up's delta). The merge then applies them to the checkpoint's
    per-expert tensors like any other LoRA; peft's own save leaves them out (NF4Experts is not a tuner layer).
    gpt-oss stores gate_up fused, so its factors are saved whole per expert (`<block>.<e>.gate_up_proj`, B's rows
    in the fused, interleaved order) and the merge stacks them onto the fused tensor."""
    out = {}
    for block, module in _lora_blocks(model):
        for projection in module.lora_projections():
            a, b = getattr(module, f"{projection}_lora_A"), getattr(module, f"{projection}_lora_B")
            held = module.stored[projection]
            for e in range(module.num_experts):
                for proj, b_rows in zip(held, b[e].chunk(len(held))):
                    # host copies: safetensors refuses tensors that share memory (B's halves, A given twice), and
                    # copies on the device would add the whole expert LoRA (1.5 GiB at Qwen3-30B-A3B, r=8) to a card
                    # the training step has just filled
                    out[per_expert_lora_key(block, e, proj, "A")] = a[e].detach().to("cpu", copy=True)
                    out[per_expert_lora_key(block, e, proj, "B")] = b_rows.detach().to("cpu", copy=True)
    return out


def load_expert_lora(model: nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Set the experts' LoRA of `model` from an adapter file's tensors (`expert_lora_checkpoint`'s keys);
    returns how many blocks were set. peft's load does not reach them: it converts per-expert LoRA keys to
    its own fused-experts layout, which NF4Experts does not use.

    Raises:
        ValueError: the file has some of a block's factors but not all, or gate and up with different A.
    """
    loaded = 0
    for block, module in _lora_blocks(model):
        found = False
        for projection in module.lora_projections():
            held = module.stored[projection]
            rows = {
                half: [
                    [tensors.get(per_expert_lora_key(block, e, p, half)) for p in held]
                    for e in range(module.num_experts)
                ]
                for half in ("A", "B")
            }
            given = [t is not None for half in rows.values() for row in half for t in row]
            if not any(given):
                continue
            if not all(given):
                raise ValueError(
                    f"{block}: the adapter has {sum(given)} of the {len(given)} LoRA factors of {projection}"
                )
            if any(not torch.equal(row[0], t) for row in rows["A"] for t in row[1:]):
                raise ValueError(f"{block}: {', '.join(held)} have different lora_A; {projection} shares one")
            with torch.no_grad():
                getattr(module, f"{projection}_lora_A").copy_(torch.stack([row[0] for row in rows["A"]]))
                getattr(module, f"{projection}_lora_B").copy_(torch.stack([torch.cat(row) for row in rows["B"]]))
            found = True
        loaded += found
    return loaded


def _lora_blocks(model: nn.Module) -> list[tuple[str, NF4Experts]]:
    """(name, module) of every NF4Experts of `model` that carries LoRA."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, NF4Experts) and m.lora_projections()]
