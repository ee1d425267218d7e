"""NF4 storage for fused 3-D mixture-of-experts weights, and an experts module that trains LoRA on it.

transformers 5 stores experts as one 3-D parameter per projection (`Qwen3MoeExperts.gate_up_proj`
[E, 2*I, H]); bitsandbytes quantizes 2-D linears only (bitsandbytes#1849), so Qwen3-30B-A3B would stay
at ~61 GB of bf16. Here each expert matrix is quantized to NF4 with double quantization (blocksize 64),
byte-for-byte what `bitsandbytes.functional.quantize_4bit(w[e], "nf4", compress_statistics=True)`
gives, but stacked: one tensor per field for all experts, so a layer holds six tensors, not 2*E
`QuantState`s. `quant_state(e)` hands bitsandbytes (or `slimtune.kernels.nf4.dequantize_nf4`) views
of one expert.

`NF4Experts` replaces `Qwen3MoeExperts` or `GptOssExperts` with the same forward signature and the
same routing (tokens grouped per expert exactly as transformers does, so outputs are bitwise equal to
transformers' eager path on the dequantized weights). Only the experts a batch hits are dequantized,
one at a time, and `_NF4ExpertMatmul` dequantizes again in backward instead of saving the weight:
saving it would keep every hit expert's dense matrix alive until backward (~1.5 GiB per
Qwen3-30B-A3B layer in bf16), which is the memory NF4 was meant to save. `nf4_expert_matmul` is the
one function a grouped GPU kernel replaces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from bitsandbytes.functional import QuantState, create_dynamic_map, dequantize_4bit, get_4bit_type
from torch import nn

from slimtune.models.experts import EXPERT_CLASSES, HELD, per_expert_lora_key, stored_projections

BLOCKSIZE = 64  # NF4 block, as bitsandbytes' default and QLoRA's
_BLOCKSIZE2 = 256  # blocks of absmax values that bitsandbytes' double quantization uses
CHUNK_ELEMENTS = 1 << 26  # fp32 temporaries of quantization bounded to ~256 MiB per chunk of experts
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

    def dequantize(self, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert `e`'s matrix in `dtype` (default the quantized weight's), equal to bitsandbytes' `dequantize_4bit`.

        Same arithmetic and roundings as bitsandbytes: absmax = fp32(code2[q] * absmax2) + offset (two
        roundings), then fp32(code[nibble] * absmax) rounded once to `dtype`. On CUDA bitsandbytes' own kernel
        does it in one launch (a step calls this three times per routed expert and layer); elsewhere torch ops.
        """
        if self.packed.is_cuda:
            return dequantize_4bit(self.packed[e].unsqueeze(1), self.quant_state(e, dtype))
        n_blocks = self.absmax.shape[1]
        absmax = self.code2[self.absmax[e].long()] * self.absmax2[e].repeat_interleave(_BLOCKSIZE2)[:n_blocks]
        absmax = absmax + self.offset[e]
        packed = self.packed[e]
        nibbles = torch.stack((packed >> 4, packed & 15), dim=-1).view(-1, BLOCKSIZE).long()
        values = self.code[nibbles] * absmax.unsqueeze(1)
        return values.view(self.shape).to(dtype or self.dtype)


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

    def dequantize(self, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert `e`'s fused matrix: its stored matrices' dequantizations, stacked by rows."""
        return torch.cat([p.dequantize(e, dtype) for p in self.parts])


class _NF4ExpertMatmul(torch.autograd.Function):
    """`x @ W_e^T` (or `x @ W_e` when the storage is transposed) with W_e a constant dequantized in both passes."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weights: NF4ExpertWeights | NF4ExpertRows, e: int, transposed: bool
    ) -> torch.Tensor:
        ctx.weights, ctx.e, ctx.transposed = weights, e, transposed
        w = weights.dequantize(e, x.dtype)
        return x @ w if transposed else F.linear(x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        w = ctx.weights.dequantize(ctx.e, grad.dtype)
        return (grad @ w.t() if ctx.transposed else grad @ w), None, None, None


def nf4_expert_matmul(
    x: torch.Tensor, weights: NF4ExpertWeights | NF4ExpertRows, e: int, transposed: bool
) -> torch.Tensor:
    """The tokens routed to expert `e` through its frozen NF4 matrix; the op a grouped kernel replaces."""
    return _NF4ExpertMatmul.apply(x, weights, e, transposed)


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

    def _project(self, x: torch.Tensor, name: str, e: int, loras: dict[str, tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One projection of expert `e`'s tokens: frozen NF4, + bias (gpt-oss), + LoRA."""
        y = nf4_expert_matmul(x, getattr(self, name), e, self.transposed)
        bias = getattr(self, f"{name}_bias")
        if bias is not None:
            y = y + bias[e]
        if name in loras:
            lora_a, lora_b = loras[name]
            delta = (self.lora_dropout(x).to(lora_a[e].dtype) @ lora_a[e].t()) @ lora_b[e].t()
            y = y + (delta * self.lora_scale).to(y.dtype)
        return y

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """transformers' eager experts loop (`Qwen3MoeExperts.forward`), same grouping and accumulation order, with
        every expert's tokens found at once: one host sync per layer where `torch.where` per expert took one each
        (128 per layer and pass at Qwen3-30B-A3B, stalling the queue behind each)."""
        loras = {  # unbind once: indexing the stacked parameter per expert would backprop E full-size zeros
            name: (getattr(self, f"{name}_lora_A").unbind(0), getattr(self, f"{name}_lora_B").unbind(0))
            for name in self.lora_projections()
        }
        final_hidden_states = torch.zeros_like(hidden_states)
        tokens = hidden_states.shape[0]
        with torch.no_grad():  # every expert's (top-k slot, token) pairs in the order torch.where gives them
            slots = top_k_index.t().reshape(-1)  # slot j = position * tokens + token
            order = torch.argsort(slots, stable=True)
            counts = torch.bincount(slots, minlength=self.num_experts + 1).tolist()  # the layer's one host sync
        groups = zip(range(self.num_experts), (order // tokens).split(counts), (order % tokens).split(counts))
        for expert_idx, top_k_pos, token_idx in groups:
            if not counts[expert_idx]:
                continue
            hidden = self.gate_fn(self._project(hidden_states[token_idx], "gate_up", expert_idx, loras))
            hidden = self._project(hidden, "down", expert_idx, loras)
            hidden = hidden * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, hidden.to(final_hidden_states.dtype))
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
