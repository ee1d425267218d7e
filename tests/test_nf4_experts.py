"""NF4 experts against bitsandbytes (bytes), transformers' experts (forward/backward) and a dense LoRA reference."""

import copy

import bitsandbytes.functional as bnbf
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from slimtune.kernels.nf4_experts import (
    NF4Experts,
    expert_lora_checkpoint,
    load_expert_lora,
    quantize_experts,
    quantize_model_experts,
)

FAMILIES = ("qwen3_moe", "gpt_oss")
_E, _TOKENS, _EMPTY = 8, 24, 3  # expert 3 gets no token in the routing tests


def _tiny_model(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A 2-layer, 8-expert, top-2 model with random weights; gpt-oss's zero-initialised biases made random."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        experts_implementation="eager",  # the per-expert loop NF4Experts mirrors (not grouped_mm)
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=_E, **common)
        model = Qwen3MoeForCausalLM(config)
    else:
        config = GptOssConfig(intermediate_size=32, num_local_experts=_E, attn_implementation="eager", **common)
        model = GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.02)
                layer.mlp.experts.down_proj_bias.normal_(0, 0.02)
    return model.to(dtype)


def _experts(model: torch.nn.Module, layer: int = 0) -> torch.nn.Module:
    return model.model.layers[layer].mlp.experts


def _routing(hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens, top-2 experts per token drawn from all but `_EMPTY`, softmax weights."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(_TOKENS, hidden, generator=gen, dtype=dtype)
    allowed = torch.tensor([e for e in range(_E) if e != _EMPTY])
    index = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:2]] for _ in range(_TOKENS)])
    weights = torch.softmax(torch.randn(_TOKENS, 2, generator=gen), dim=-1).to(dtype)
    return x, index, weights


def _dequantized(nf4: NF4Experts, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Both projections of every expert, dequantized and stacked in the transformers parameter layout."""
    return {f"{name}_proj": getattr(nf4, name).dequantize_experts(0, _E, dtype) for name in ("gate_up", "down")}


def _flat_dequantize(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' NF4 dequantization as its CUDA kernel and its generic torch path compute it: blocks of 64
    one after another over the flattened matrix, the absmax from its 8-bit second level plus the offset. Its
    AVX-512 CPU kernel (bitsandbytes 0.50.2) gives other values where a row is not a whole number of blocks
    (measured on 96-column matrices), so that kernel is the reference only for rows of whole blocks."""
    absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    nibbles = torch.stack((packed.view(-1) >> 4, packed.view(-1) & 15), dim=-1).view(-1, 64).long()
    return (state.code[nibbles] * absmax.unsqueeze(1)).view(state.shape).to(state.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_experts_equals_bitsandbytes_per_expert(family, dtype):
    experts = _experts(_tiny_model(family, dtype))
    weights = {name: getattr(experts, name).detach() for name in ("gate_up_proj", "down_proj")}
    weights["tall"] = torch.randn(3, 320, 64, dtype=dtype)  # 320 blocks: two second-level blocks, the last padded
    for name, weight in weights.items():
        storage = quantize_experts(weight)
        for e in range(weight.shape[0]):
            packed, state = bnbf.quantize_4bit(weight[e], quant_type="nf4", compress_statistics=True, blocksize=64)
            ours = storage.quant_state(e)
            assert torch.equal(storage.packed[e], packed.view(-1)), (name, e)
            assert torch.equal(ours.absmax, state.absmax), (name, e)
            assert torch.equal(ours.offset, state.offset), (name, e)
            assert torch.equal(ours.state2.absmax, state.state2.absmax), (name, e)
            assert torch.equal(ours.state2.code, state.state2.code)
            assert torch.equal(ours.code, state.code)
            assert (ours.shape, ours.dtype, ours.blocksize, ours.state2.blocksize, ours.quant_type) == (
                state.shape,
                state.dtype,
                state.blocksize,
                state.state2.blocksize,
                state.quant_type,
            )
            reference = bnbf.dequantize_4bit(packed, state)
            assert torch.equal(bnbf.dequantize_4bit(storage.packed[e], ours), reference), (name, e)
            flat = _flat_dequantize(packed, state)
            assert torch.equal(storage.dequantize_experts(e, e + 1)[0], flat), (name, e)
            if weight.shape[-1] % 64 == 0:  # rows of whole blocks: bitsandbytes' CPU kernel computes the same
                assert torch.equal(flat, reference), (name, e)
            assert not torch.equal(reference, weight[e])  # NF4 is lossy: the comparison above is not vacuous


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-chunk", "expert-by-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_input_grad_equal_transformers_on_dequantized_weights(family, dtype, chunk_bytes, monkeypatch):
    """The grouped GEMMs, over all experts dequantized at once or one expert per chunk (the empty expert's chunk
    skipped), give transformers' eager output and input gradient bit for bit."""
    if chunk_bytes is not None:
        monkeypatch.setattr("slimtune.kernels.nf4_experts.DEQUANT_CHUNK_BYTES", chunk_bytes)
    reference = _experts(_tiny_model(family, dtype))
    nf4 = NF4Experts.from_experts(copy.deepcopy(reference), dtype)
    with torch.no_grad():
        for name, value in _dequantized(nf4, dtype).items():
            getattr(reference, name).copy_(value)
    reference.requires_grad_(False)
    x, index, weights = _routing(64, dtype)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = reference(x_ref, index, weights), nf4(x_ours, index, weights)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    # Same ops in the same order on the same dequantized values: bitwise equal, not merely close.
    assert torch.equal(got, expected)
    assert torch.equal(x_ours.grad, x_ref.grad)
    assert got.abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_output_and_grads_equal_dense_float32_reference(family):
    """LoRA as two small matmuls beside NF4 equals one dense matmul by W_e + scale * B_e A_e (fp32)."""
    reference = _experts(_tiny_model(family))
    nf4 = NF4Experts.from_experts(copy.deepcopy(reference), torch.float32)
    nf4.add_lora(rank=4, scale=2.0)
    with torch.no_grad():
        for name in ("gate_up", "down"):
            getattr(nf4, f"{name}_lora_B").normal_(0, 0.05)  # non-zero B: the adapter moves the output
    dense = _dequantized(nf4, torch.float32)
    lora = {name: (getattr(nf4, f"{name}_lora_A"), getattr(nf4, f"{name}_lora_B")) for name in ("gate_up", "down")}
    ref_lora = {
        name: (a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_())
        for name, (a, b) in lora.items()
    }
    merged = {}
    for name, (a, b) in ref_lora.items():
        delta = nf4.lora_scale * (b @ a)  # [E, out, in]
        merged[f"{name}_proj"] = dense[f"{name}_proj"] + (delta.transpose(1, 2) if nf4.transposed else delta)
    x, index, weights = _routing(64, torch.float32)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = functional_call(reference, merged, (x_ref, index, weights))
    got = nf4(x_ours, index, weights)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    base = functional_call(reference, dense, (x, index, weights))
    assert (got - base).abs().max() > 1e-3  # the adapter is not the identity
    # Both sides are fp32 and differ only in summation order (x @ (W + sBA)^T vs x @ W^T + s (x A^T) B^T): measured
    # max errors 2e-8 on outputs of ~0.09 and 3e-7 on LoRA gradients of ~1.4, i.e. ~2e-7 relative (a few fp32 ulps
    # times sums of <= 64 terms). rtol 1e-5 leaves 50x room; a 1% error in the LoRA scale gives 2e-4..3e-2 (measured).
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **tol)
    for name, (a, b) in lora.items():
        ref_a, ref_b = ref_lora[name]
        torch.testing.assert_close(a.grad, ref_a.grad, **tol)
        torch.testing.assert_close(b.grad, ref_b.grad, **tol)
        assert a.grad[_EMPTY].abs().max() == 0 and b.grad[_EMPTY].abs().max() == 0  # no token, no gradient
        assert a.grad.abs().max() > 0 and b.grad.abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_loss_within_nf4_error_and_router_loss_kept(family):
    model = _tiny_model(family)
    with torch.no_grad():  # larger expert weights than the 0.02 init, so quantization moves the loss measurably
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    dense = model(ids, labels=ids, output_router_logits=True)
    quantized, dequantized = copy.deepcopy(model), copy.deepcopy(model)
    assert quantize_model_experts(quantized, torch.float32) == 2
    with torch.no_grad():  # transformers' own model on the weights NF4 stores
        for plain, nf4 in zip(dequantized.model.layers, quantized.model.layers):
            for name, value in _dequantized(nf4.mlp.experts, torch.float32).items():
                getattr(plain.mlp.experts, name).copy_(value)
    out = quantized(ids, labels=ids, output_router_logits=True)
    reference = dequantized(ids, labels=ids, output_router_logits=True)
    # The swap changes nothing but the weights: loss, logits and aux loss equal the dequantized model's exactly.
    assert torch.equal(out.loss, reference.loss) and torch.equal(out.logits, reference.logits)
    assert torch.equal(out.aux_loss, reference.aux_loss)
    # NF4's error (measured RMS 9.3% of these Gaussian weights) moves this tiny random model's loss by a measured
    # 4.7e-3 (qwen3_moe) and 1.6e-2 (gpt_oss) at loss ~4.9. 3e-2 states that bound; it is too loose to catch a wrong
    # expert (which moved it 8e-3 / 4e-2): the exact equality with the dequantized model above does that.
    assert 0 < abs(out.loss.item() - dense.loss.item()) < 3e-2
    torch.testing.assert_close(out.router_logits[0], dense.router_logits[0], rtol=0, atol=0)  # first router: same input
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, 128).float(), ids[:, 1:].reshape(-1))
    coef = quantized.config.router_aux_loss_coef
    torch.testing.assert_close(out.loss, ce + coef * out.aux_loss, rtol=1e-6, atol=1e-6)  # the model's own aux path


@pytest.mark.parametrize("family", FAMILIES)
def test_model_trains_lora_only_through_nf4_experts(family):
    model = _tiny_model(family)
    quantize_model_experts(model, torch.float32)
    model.requires_grad_(False)
    layers = [layer.mlp.experts for layer in model.model.layers]
    for experts in layers:
        experts.add_lora(rank=4, scale=2.0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids, output_router_logits=True).loss.backward()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"model.layers.{i}.mlp.experts.{proj}_lora_{ab}"
        for i in range(2)
        for proj in ("gate_up", "down")
        for ab in "AB"
    }
    for experts in layers:  # B starts at zero, so only B gets a gradient on the first step (as in peft)
        assert experts.gate_up_lora_B.grad.abs().max() > 0 and experts.down_lora_B.grad.abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_from_experts_keeps_no_dense_expert_tensor(family):
    experts = _experts(_tiny_model(family, torch.bfloat16))
    gate_up, down = experts.gate_up_proj.shape, experts.down_proj.shape
    nf4 = NF4Experts.from_experts(experts, torch.bfloat16)
    assert experts.gate_up_proj is None and experts.down_proj is None  # the dense originals are dropped
    tensors = list(nf4.parameters()) + list(nf4.buffers())
    smallest_matrix = min(gate_up[1] * gate_up[2], down[1] * down[2])
    assert all(t.dtype == torch.uint8 or t.numel() < smallest_matrix for t in tensors)
    packed = _E * (gate_up[1] * gate_up[2] + down[1] * down[2]) // 2
    # Qwen3-MoE's gate and up are quantized apart, as its checkpoint stores them (NF4ExpertRows)
    halves = [(gate_up[1] // 2, gate_up[2])] * 2 if family == "qwen3_moe" else [gate_up[1:]]
    blocks = [_E * shape[0] * shape[1] // 64 for shape in (*halves, down[1:])]
    statistics = sum(
        n + 4 * _E * -(-n // _E // 256) + 4 * _E + 4 * (16 + 256) for n in blocks
    )  # absmax, absmax2, offset, codes
    biases = 2 * _E * (gate_up[2] + down[2]) if family == "gpt_oss" else 0  # bf16 [E, 2I] and [E, H], gpt-oss only
    expected = packed + statistics + biases
    assert sum(t.numel() * t.element_size() for t in tensors) == expected


def test_expert_lora_is_saved_per_expert_and_loads_back():
    """The adapter file's expert LoRA: per expert under the checkpoint's projection names (gate and up share
    gate_up's A and split its B), back into the stacked parameters exactly; partial or inconsistent files refused."""
    model = _tiny_model("qwen3_moe")
    quantize_model_experts(model, torch.float32)
    g = torch.Generator().manual_seed(0)
    for block in (m for m in model.modules() if isinstance(m, NF4Experts)):
        block.add_lora(rank=4, scale=2.0)
        for name in ("gate_up", "down"):
            b = getattr(block, f"{name}_lora_B")
            b.data = torch.randn(b.shape, generator=g)
    saved = expert_lora_checkpoint(model)
    layer = _experts(model)
    width = layer.gate_up_lora_B.shape[1] // 2
    assert len(saved) == 2 * _E * 3 * 2  # layers x experts x (gate, up, down) x (A, B)
    e = 5
    assert torch.equal(saved[f"model.layers.0.mlp.experts.{e}.up_proj.lora_B.weight"], layer.gate_up_lora_B[e, width:])
    assert torch.equal(saved[f"model.layers.0.mlp.experts.{e}.gate_proj.lora_A.weight"], layer.gate_up_lora_A[e])
    assert torch.equal(saved[f"model.layers.0.mlp.experts.{e}.down_proj.lora_B.weight"], layer.down_lora_B[e])

    fresh = _tiny_model("qwen3_moe")
    quantize_model_experts(fresh, torch.float32)
    for block in (m for m in fresh.modules() if isinstance(m, NF4Experts)):
        block.add_lora(rank=4, scale=2.0)
    assert load_expert_lora(fresh, saved) == 2
    for name in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
        assert torch.equal(getattr(_experts(fresh), name), getattr(layer, name)), name

    partial = {k: v for k, v in saved.items() if ".experts.3.down_proj" not in k}
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts: the adapter has 14 of the 16 LoRA factors"):
        load_expert_lora(fresh, partial)
    other_a = {**saved, "model.layers.1.mlp.experts.0.up_proj.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(ValueError, match="gate_proj, up_proj have different lora_A"):
        load_expert_lora(fresh, other_a)
