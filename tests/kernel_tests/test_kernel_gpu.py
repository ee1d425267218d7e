"""Every kernel at Llama-3.1-8B shapes on a CUDA GPU, against its reference (run through the device tool).

Shapes: hidden 4096, intermediate 14336, vocab 128256, 32 query / 8 KV heads of 128, seq 2048.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

H, I, V, T, HQ, HK, D = 4096, 14336, 128256, 2048, 32, 8, 128
BF16_REL = 2**-6  # two bf16 roundings (8 significant bits each)


def _cuda():
    return torch.device("cuda")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_8b(gemma):
    from slimtune.kernels.rms_norm import reference_rms_norm, rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, T, H, device=_cuda(), generator=g).bfloat16().requires_grad_()
    w = (torch.randn(H, device=_cuda(), generator=g) * 0.1 + (0 if gemma else 1)).bfloat16().requires_grad_()
    dy = torch.randn(2, T, H, device=_cuda(), generator=g).bfloat16()
    y = rms_norm(x, w, 1e-5, gemma)
    y.backward(dy)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y32 = reference_rms_norm(x32, w32, 1e-5, gemma)
    y32.backward(dy.float())
    torch.testing.assert_close(y.float(), y32, rtol=BF16_REL, atol=BF16_REL)
    torch.testing.assert_close(x.grad.float(), x32.grad, rtol=BF16_REL, atol=BF16_REL)
    # dw sums 4096 rows: relative norm error, bf16 output rounding dominates
    assert _rel_err(w.grad, w32.grad) < 2**-7


def test_rope_8b_packed():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from slimtune.kernels.rope import reference_rope, rope_

    cfg = LlamaConfig(
        hidden_size=H,
        num_attention_heads=HQ,
        num_key_value_heads=HK,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    rotary = LlamaRotaryEmbedding(cfg).to(_cuda())
    # two packed examples per row: positions restart at 0 in the middle
    pos = torch.cat([torch.arange(T // 2 + 7), torch.arange(T - T // 2 - 7)])
    pos = pos.view(1, T).repeat(2, 1).to(_cuda())
    q = torch.randn(2, T, HQ, D, device=_cuda()).bfloat16()
    k = torch.randn(2, T, HK, D, device=_cuda()).bfloat16()
    cos, sin = rotary(q, pos)
    qr, kr = reference_rope(q.float(), k.float(), cos.float(), sin.float())
    q_in, k_in = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = rope_(q_in * 1, k_in * 1, cos, sin)
    torch.testing.assert_close(qo.float(), qr, rtol=BF16_REL, atol=BF16_REL)
    torch.testing.assert_close(ko.float(), kr, rtol=BF16_REL, atol=BF16_REL)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo.float() * gq.float()).sum() + (ko.float() * gk.float()).sum()).backward()
    q32, k32 = q.float().requires_grad_(), k.float().requires_grad_()
    a, b = reference_rope(q32, k32, cos.float(), sin.float())
    ((a * gq.float()).sum() + (b * gk.float()).sum()).backward()
    torch.testing.assert_close(q_in.grad.float(), q32.grad, rtol=BF16_REL, atol=BF16_REL)
    torch.testing.assert_close(k_in.grad.float(), k32.grad, rtol=BF16_REL, atol=BF16_REL)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_8b(act):
    from slimtune.kernels.swiglu import gated_act, reference_gated_act

    gate = torch.randn(2, T, I, device=_cuda()).bfloat16().requires_grad_()
    up = torch.randn(2, T, I, device=_cuda()).bfloat16().requires_grad_()
    h = gated_act(gate, up, act)
    dh = torch.randn_like(h)
    h.backward(dh)
    g32, u32 = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    reference_gated_act(g32, u32, act).backward(dh.float())
    ref = reference_gated_act(g32, u32, act).detach()
    torch.testing.assert_close(h.float(), ref, rtol=BF16_REL, atol=BF16_REL)
    torch.testing.assert_close(gate.grad.float(), g32.grad, rtol=BF16_REL, atol=BF16_REL)
    torch.testing.assert_close(up.grad.float(), u32.grad, rtol=BF16_REL, atol=BF16_REL)


def test_fused_ce_8b_matches_and_never_builds_full_logits():
    from slimtune.kernels.fused_linear_ce import fused_linear_cross_entropy, reference_linear_cross_entropy

    n = 4 * T  # batch 4 x 2048: the fp32 logits would be 4 GiB
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, H, device=_cuda(), generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device=_cuda(), generator=g) * 0.02).bfloat16()
    labels = torch.randint(0, V, (n,), device=_cuda(), generator=g)
    labels[: n // 3] = -100
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 1 << 30, f"fused CE used {extra / 2**30:.2f} GiB extra; bf16 logits alone would be 2 GiB"
    h32 = hidden.detach().float().requires_grad_()
    ref = reference_linear_cross_entropy(h32, weight.float(), labels)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)  # bf16 logits, averaged over 5461 tokens
    assert _rel_err(hidden.grad, h32.grad) < 2**-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "plain_absmax"])
def test_nf4_8b_bit_exact_with_bitsandbytes_cuda(dtype, double_quant):
    """On the GPU the compiler may contract a * b + c into one FMA; the CPU interpreter never does, so only
    this test can catch a lost rounding in the double-quantized absmax."""
    import bitsandbytes.functional as bnbf

    from slimtune.kernels.nf4 import dequantize_nf4, dequantize_nf4_scratch

    w = (torch.randn(I, H, device=_cuda()) * 0.02).to(dtype)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
    ref = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
    assert torch.equal(dequantize_nf4(packed, state).view(torch.int16), ref.view(torch.int16))
    assert torch.equal(dequantize_nf4_scratch(packed, state).view(torch.int16), ref.view(torch.int16))


def _gate_proj_case():
    """An 8B gate projection in NF4 with LoRA factors, a 2048-token input and an output gradient."""
    import bitsandbytes.functional as bnbf

    w = (torch.randn(I, H, device=_cuda()) * 0.02).bfloat16()
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    x = torch.randn(T, H, device=_cuda()).bfloat16().requires_grad_()
    a = (torch.randn(16, H, device=_cuda()) * 0.02).requires_grad_()
    b = (torch.randn(I, 16, device=_cuda()) * 0.02).requires_grad_()
    return packed, state, x, a, b, torch.randn(T, I, device=_cuda()).bfloat16()


def test_lora_nf4_linear_ignores_what_its_fresh_buffers_held():
    """The forward and backward write into `empty` buffers with beta=0 GEMMs: memory the caching allocator
    hands back full of NaN must not leak into the outputs or the gradients."""
    from slimtune.kernels.lora_linear import lora_nf4_linear

    packed, state, x, a, b, dy = _gate_proj_case()
    for _ in range(2):  # free blocks of every size the call allocates, filled with NaN
        junk = [torch.full((n,), float("nan"), device=_cuda(), dtype=torch.bfloat16) for n in (T * I, T * H, T * 16)]
        junk += [torch.full((n,), float("nan"), device=_cuda()) for n in (I * 16, 16 * H)]
        del junk
    y = lora_nf4_linear(x, packed, state, None, a, b, 2.0)
    y.backward(dy)
    for t in (y, x.grad, a.grad, b.grad):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("shape", [(H, H), (I, H), (H, I)], ids=["q_proj", "gate_proj", "down_proj"])
def test_lora_nf4_linear_8b(shape):
    import bitsandbytes.functional as bnbf

    from slimtune.kernels.lora_linear import lora_nf4_linear

    out_f, in_f = shape
    w = (torch.randn(out_f, in_f, device=_cuda()) * 0.02).bfloat16()
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    x = torch.randn(T, in_f, device=_cuda()).bfloat16().requires_grad_()
    a = (torch.randn(16, in_f, device=_cuda()) * 0.02).requires_grad_()
    b = (torch.randn(out_f, 16, device=_cuda()) * 0.02).requires_grad_()
    y = lora_nf4_linear(x, packed, state, None, a, b, 2.0)
    dy = torch.randn_like(y)
    y.backward(dy)
    x32, a32, b32 = (t.detach().float().requires_grad_() for t in (x, a, b))
    wd = bnbf.dequantize_4bit(packed, state).float()
    y32 = x32 @ wd.t() + 2.0 * (x32 @ a32.t()) @ b32.t()
    y32.backward(dy.float())
    for got, ref in ((y, y32), (x.grad, x32.grad), (a.grad, a32.grad), (b.grad, b32.grad)):
        assert _rel_err(got, ref) < 2**-6  # bf16 operands, fp32 accumulation


def test_lora_nf4_step_never_syncs_with_the_host():
    """A host sync per dequantization (reading the double-quant offset) once idled the GPU ~30% of a step."""
    from slimtune.kernels.lora_linear import lora_nf4_linear

    packed, state, x, a, b, dy = _gate_proj_case()
    lora_nf4_linear(x, packed, state, None, a, b, 2.0).backward(dy)  # warm-up: compile, allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_nf4_linear(x, packed, state, None, a, b, 2.0).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_host_embedding_8b_gathers_exactly_from_pinned_memory_without_syncing():
    from slimtune.kernels.host_embedding import gather_rows, to_host

    table_gpu = torch.randn(V, H, device=_cuda()).bfloat16()
    table = to_host(table_gpu)
    assert table.device.type == "cpu" and table.is_pinned()
    ids = torch.randint(0, V, (4, T), device=_cuda())
    ids[0, :3] = torch.tensor([0, V - 1, 5])
    gather_rows(table, ids)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = gather_rows(table, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda" and torch.equal(got, table_gpu[ids])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_auto_on_gpu_bf16_tiny_model(family):
    from slimtune.kernels import apply_kernels
    from slimtune.models.tiny import build_model

    model = build_model(family, 512, num_hidden_layers=2).to(_cuda(), torch.bfloat16).train()
    ids = torch.randint(0, 512, (2, 64), device=_cuda())
    labels = ids.clone()
    labels[:, :16] = -100

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}

    ref_loss, ref_grads = step()
    patch = apply_kernels(model, "auto")
    assert {"rms_norm", "rope", "fused_linear_ce"} <= set(patch.applied)
    loss, grads = step()
    patch.undo()
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)  # bf16 model end to end
    for name, g in grads.items():
        assert _rel_err(g, ref_grads[name]) < 0.05, name


def test_auto_on_gpu_qlora_tiny_model(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from slimtune.kernels import apply_kernels
    from slimtune.models.tiny import save_tiny

    path = save_tiny(tmp_path / "llama", "llama", num_hidden_layers=2)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    base = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.bfloat16, device_map={"": 0}
    )
    model = get_peft_model(
        base,
        LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    ).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, base.config.vocab_size, (2, 128), device=_cuda())
    labels = ids.clone()
    labels[:, :32] = -100

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return out.loss.detach(), grads

    ref_loss, ref_grads = step()
    table_bytes = base.get_input_embeddings().weight.nbytes
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    patch = apply_kernels(model, "auto")
    assert patch.modules.get("lora_nf4") == 14, patch.skipped
    assert patch.modules.get("host_embedding") == 1, patch.skipped
    assert before - torch.cuda.memory_allocated() >= table_bytes  # the table left the GPU
    loss, grads = step()
    patch.undo()
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)  # bf16 activations end to end
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert _rel_err(g, ref_grads[name]) < 0.05, name  # bf16 LoRA math vs peft's fp32 adapter path


def test_compiled_deltanet_mixer_equals_eager_at_qwen35_4b_widths():
    """The product runs the Gated DeltaNet between its projections compiled whole on a GPU (conv, gates, delta rule,
    gated norm): on packed rows at Qwen3.5-4B's widths (16 key / 32 value heads of 128, conv over 8192 channels),
    outputs and the gradients of every input equal the eager function's, which the CPU tests hold to transformers'
    (tests/test_family_qwen35.py, tests/test_delta_rule.py)."""
    from transformers.activations import ACT2FN

    from slimtune.train.step.deltanet_mixer import compiled_gated_delta_mixer, gated_delta_mixer

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device=_cuda(), generator=g) * scale).to(dtype).requires_grad_()

    key_dim, value_dim, heads = 16 * D, 32 * D, 32
    qkv, z = rand(2, T, 2 * key_dim + value_dim), rand(2, T, value_dim)
    b, a = rand(2, T, heads), rand(2, T, heads)
    conv_weight, norm_weight = rand(2 * key_dim + value_dim, 1, 4, scale=0.5), rand(D, scale=0.1)
    a_log, dt_bias = rand(heads, scale=0.5, dtype=torch.float32), rand(heads, dtype=torch.float32)
    starts = torch.zeros(2, T, dtype=torch.bool, device=_cuda())
    starts[:, torch.tensor([0, 300, 301, 1000, 1999])] = True  # documents of 300, 1, 699, 999 and 49 tokens
    positions = torch.arange(T, device=_cuda()) - (starts * torch.arange(T, device=_cuda())).cummax(1).values
    inputs = [qkv, z, b, a, positions, conv_weight, None, a_log, dt_bias, norm_weight]
    rest = (ACT2FN["silu"], key_dim, D, D, 1e-6)
    dy = torch.randn(2, T, value_dim, device=_cuda(), generator=g).bfloat16()
    eager = gated_delta_mixer(*inputs, *rest)
    compiled = compiled_gated_delta_mixer()(*inputs, *rest)
    assert _rel_err(compiled, eager) < BF16_REL
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    for x, c, e in zip(leaves, torch.autograd.grad(compiled, leaves, dy), torch.autograd.grad(eager, leaves, dy)):
        assert _rel_err(c, e) < BF16_REL, tuple(x.shape)


def test_host_lm_head_8b_equals_the_fused_loss_and_holds_a_chunk_of_the_head():
    """Llama-3.1-8B's head (0.98 GiB) in pinned host memory, 2 x 2048 tokens: the streamed loss and d(hidden) equal
    the fused loss's with the head on the GPU within bf16 rounding, and the step holds two head chunks, one chunk of
    logits and the per-token buffers, not the head."""
    from slimtune.kernels.fused_linear_ce import fused_linear_cross_entropy
    from slimtune.kernels.host_embedding import to_host

    torch.manual_seed(0)
    vocab, hidden, tokens = 128256, 4096, 4096
    weight = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(torch.bfloat16)
    table = to_host(weight)
    h = torch.randn(2, tokens // 2, hidden, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (2, tokens // 2), device="cuda")
    labels[:, ::5] = -100

    def run(w):
        x = h.detach().clone().requires_grad_()
        loss = fused_linear_cross_entropy(x, w, labels)
        loss.backward()
        return loss.detach(), x.grad

    ref_loss, ref_dh = run(weight)
    del weight
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss, dh = run(table)
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() - before
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dh.float(), ref_dh.float(), rtol=2**-5, atol=1e-6)
    # head and logits chunks 3 x 32 MiB, per token 4096 x (4 + 3 x 2) bytes: 256 MiB; the head alone is 1002 MiB
    assert held < 300 * 2**20, held / 2**20


def test_tables_loaded_into_host_memory_are_used_there_by_both_host_kernels(tmp_path):
    """load_4bit's path for a card too small for the head (`slimtune.tasks.load_tables`): both tables arrive in
    pinned host memory, `host_embedding` and `host_lm_head` take them as they are (they stay there), and the loss and
    gradients equal those of the same model with its tables on the GPU and the fused loss there."""
    from transformers import LlamaForCausalLM

    from slimtune.kernels import apply_kernels
    from slimtune.models.tiny import save_tiny
    from slimtune.tasks.load_tables import load_host_tables, without_tables

    model_dir = save_tiny(tmp_path / "untied", "llama", tie_word_embeddings=False)
    kw = dict(dtype=torch.bfloat16, device_map={"": "cuda"})
    on_gpu = LlamaForCausalLM.from_pretrained(model_dir, **kw)
    hosted = without_tables(LlamaForCausalLM).from_pretrained(model_dir, **kw)
    load_host_tables(hosted, model_dir, torch.bfloat16, pin=True)
    assert hosted.lm_head.weight.is_pinned() and hosted.model.embed_tokens.weight.is_pinned()
    ids = torch.randint(0, on_gpu.config.vocab_size, (2, 64), device="cuda")
    results = []
    host_kernels = ["host_embedding", "host_lm_head", "fused_linear_ce"]
    for model, kernels in ((on_gpu, ["fused_linear_ce"]), (hosted, host_kernels)):
        for p in model.parameters():
            p.requires_grad_(False)
        model.model.norm.weight.requires_grad_(True)
        patch = apply_kernels(model, kernels)
        assert sorted(patch.applied) == sorted(kernels), patch.skipped
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach().float(), model.model.norm.weight.grad.float()))
    assert hosted.lm_head.weight.device.type == "cpu" and hosted.model.embed_tokens.weight.device.type == "cpu"
    (ref_loss, ref_grad), (loss, grad) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    assert _rel_err(grad, ref_grad) < 2 * BF16_REL
