"""Selection, per-instance patching and undo on tiny models of every family; LoRA grads, kernels vs off."""

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when the kernels are decorated, i.e. at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from slimtune.kernels import KERNEL_NAMES, apply_kernels, resolve_selection
from slimtune.models.families import FAMILIES
from slimtune.models.lora_targets import lora_target_modules
from slimtune.models.tiny import build_model, save_tiny

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 5), generator=g)  # few tokens: the interpreter runs one program each
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]])  # row 2 packs two examples
    labels = ids.clone()
    labels[:, :2] = -100  # completion-only: the prompt is masked
    return dict(input_ids=ids, position_ids=position_ids, labels=labels)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _own_forwards(model) -> int:
    return sum("forward" in m.__dict__ for m in model.modules())


def test_resolve_selection_rules(monkeypatch):
    assert resolve_selection("off", "cuda", "llama") == []
    assert resolve_selection("auto", "cpu", "llama") == []  # interpreter is far too slow to be automatic
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # skip the capability probe
    auto_llama = resolve_selection("auto", "cuda", "llama")
    assert "swiglu" in auto_llama and "geglu" not in auto_llama and "fused_linear_ce" in auto_llama
    assert "geglu" in resolve_selection("auto", "cuda", "gemma")
    assert resolve_selection("auto", "cuda", "gpt2") == []
    assert resolve_selection("rope, rms_norm", "cuda", "llama") == ["rope", "rms_norm"]
    with pytest.raises(ValueError, match="unknown kernel"):
        resolve_selection(["rms_norm", "flash"], "cuda", "llama")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_selection(["rope"], "cpu", "llama")


def test_auto_on_cpu_applies_nothing_and_says_why():
    model = build_model("llama", 64, num_hidden_layers=1)
    patch = apply_kernels(model, "auto")
    assert patch.applied == [] and _own_forwards(model) == 0
    assert set(patch.skipped) == set(KERNEL_NAMES) and "no CUDA device" in patch.skipped["rope"]
    assert apply_kernels(model, "off").skipped == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_matches_eager_and_undo_restores(family):
    # Qwen3.5 up to its first attention layer: a cache of DeltaNet layers alone cannot say its length
    model = build_model(family, 128, num_hidden_layers=4 if family == "qwen3_5_text" else 1).train()
    classes = {type(m): type(m).forward for m in model.modules()}
    batch = _batch(128)
    ref_out, ref_grads = _step(model, batch)
    patch = apply_kernels(model, list(KERNEL_NAMES))
    row = FAMILIES[family]
    # on a plain (not peft, CPU) model, every weight trained: every kernel of the family's math but lora_nf4 and the
    # two that move a frozen table to host memory
    assert set(patch.applied) == set(row.kernels) - {"lora_nf4", "host_embedding", "host_lm_head"}, patch.skipped
    assert "lora_nf4" in patch.skipped
    for name, why in row.eager.items():  # the table's reason is what the run reports
        assert patch.skipped[name] == f"{family}: {why} (eager)"
    if "rms_norm" in row.kernels:  # every RMSNorm: the layer's, q/k norms (Qwen3, Gemma 3) and the final one
        norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
        assert patch.modules["rms_norm"] == norms == row.layer_norms + (2 if row.qk_norm else 0) + 1
    out, grads = _step(model, batch)
    fused = "fused_linear_ce" in row.kernels
    assert (out.logits is None) == fused  # the fused loss never builds logits
    # fp32 model: kernels reorder sums only, so 1e-5 relative is ample (measured ~1e-6)
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        # a reordered sum moves by the rounding of its terms: ~1e-6 of the gradient's scale (a tied embedding's
        # element cancelling to 2e-3 in a gradient of scale 2 moved by 1.7e-6 on an AVX-512 CPU)
        scale = max(1.0, ref_grads[name].abs().max().item())
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6 * scale, msg=name)
    with torch.no_grad():  # without labels the patched model still returns logits (HF's own path)
        logits = model(input_ids=batch["input_ids"]).logits
    assert logits.shape == (2, 5, 128)
    patch.undo()
    assert _own_forwards(model) == 0 and patch.applied == []
    assert all(cls.forward is fwd for cls, fwd in classes.items())  # no class was ever touched
    again, _ = _step(model, batch)
    assert torch.equal(again.logits, ref_out.logits)


# llama; gemma2, whose post-feedforward norm reads down_proj's output; phi3, whose projections are fused
@pytest.fixture(scope="module", params=["llama", "gemma2", "phi3"])
def tiny_qlora(tmp_path_factory, request):
    family = request.param
    return _qlora(save_tiny(tmp_path_factory.mktemp("tiny") / family, family, num_hidden_layers=1), family)


def _qlora(path, family: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32)
    targets = lora_target_modules(family, LORA_TARGETS)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
    model = get_peft_model(base, config)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; non-zero B gives A a gradient and the output an adapter term
            torch.nn.init.normal_(p, std=0.05)
    return model.train()


def test_qlora_step_with_kernels_gives_the_same_lora_gradients(tiny_qlora):
    model = tiny_qlora
    batch = _batch(model.get_base_model().config.vocab_size)
    ref_out, ref_grads = _step(model, batch)
    assert ref_grads and all("lora_" in n for n in ref_grads)
    patch = apply_kernels(model, list(KERNEL_NAMES))  # auto would pick none on CPU: force every kernel
    try:
        n_targets = len(model.peft_config["default"].target_modules)
        assert "lora_nf4" in patch.applied and patch.modules["lora_nf4"] == n_targets
        out, grads = _step(model, batch)
    finally:
        patch.undo()
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g.abs().sum() > 0, name
        # fp32 compute over an NF4 base dequantized bit-exactly: differences are summation order only
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert _own_forwards(model) == 0


def test_unsloth_checkpointing_with_kernels_gives_the_same_lora_gradients(tiny_qlora, monkeypatch):
    """The recompute skips the base matmul of each layer's down_proj where its output is only added to the
    residual stream (llama, phi3), and computes it where a post-norm reads it (gemma2)."""
    from slimtune.kernels import lora_linear
    from slimtune.train.step import enable_checkpointing

    model = tiny_qlora
    batch = _batch(model.get_base_model().config.vocab_size)
    # as the pipeline trains: without a KV cache (with one, transformers ignores the packed position ids)
    monkeypatch.setattr(model.get_base_model().config, "use_cache", False)
    ref_out, ref_grads = _step(model, batch)
    calls, graphs = [], []
    original = lora_linear._LoRANF4Fn.forward

    def spy(ctx, *args):
        calls.append(args[-1])  # compute_output
        graphs.append(isinstance(ctx, torch.autograd.function.FunctionCtx))  # autograd's context, or none
        return original(ctx, *args)

    monkeypatch.setattr(lora_linear._LoRANF4Fn, "forward", staticmethod(spy))
    handle = enable_checkpointing(model, "unsloth")
    patch = apply_kernels(model, list(KERNEL_NAMES), checkpoint_pass=handle.layer_pass)
    try:
        out, grads = _step(model, batch)
    finally:
        patch.undo()
        handle.undo()
    # forward: every projection computed; recompute: down_proj's output skipped unless a post-norm reads it
    skipped = 1 if FAMILIES[model.get_base_model().config.model_type].layer_output else 0
    n_targets = len(model.peft_config["default"].target_modules)
    assert calls.count(True) == 2 * n_targets - skipped and calls.count(False) == skipped, calls
    # the first pass runs without grad and calls the forward directly; only the recompute builds a graph
    assert graphs == [False] * n_targets + [True] * n_targets, graphs
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_unsloth_recompute_reuses_the_forward_casts_and_sees_each_update(tiny_qlora, monkeypatch):
    """Under "unsloth" checkpointing the adapters are cast once per step, all projections in one bulk copy at
    the model's forward (the recompute takes the forward's casts), and a step after an in-place update of the
    adapters (as an optimizer makes, which need not bump their version) trains on the updated values: its
    gradients equal peft's, kernels off."""
    from slimtune.kernels import lora_linear
    from slimtune.train.step import enable_checkpointing

    model = tiny_qlora
    batch = _batch(model.get_base_model().config.vocab_size)
    monkeypatch.setattr(model.get_base_model().config, "use_cache", False)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    saved = [p.detach().clone() for p in adapters]
    for p in adapters:  # fp64 adapters over fp32 compute: the casts are copies, so a stale one would show
        p.data = p.data.double()
    made, bulk = [], []
    one, many = lora_linear.adapters_in, lora_linear.adapters_in_bulk

    def spy(a, b, dtype):
        made.append(dtype)
        return one(a, b, dtype)

    def spy_bulk(pairs, dtype):
        bulk.append(len(pairs))
        return many(pairs, dtype)

    monkeypatch.setattr(lora_linear, "adapters_in", spy)
    monkeypatch.setattr(lora_linear, "adapters_in_bulk", spy_bulk)
    handle = enable_checkpointing(model, "unsloth")
    patch = apply_kernels(model, list(KERNEL_NAMES), checkpoint_pass=handle.layer_pass)
    try:
        _step(model, batch)
        # one layer: one bulk cast of every projection, none of its own (not even in the recompute)
        assert bulk == [len(model.peft_config["default"].target_modules)] and made == []
        with torch.no_grad():
            for p in adapters:
                p.add_(0.1 * torch.randn_like(p))
        out, grads = _step(model, batch)
    finally:
        patch.undo()
        handle.undo()
    ref_out, ref_grads = _step(model, batch)
    for p, s in zip(adapters, saved, strict=True):  # the module-scoped fixture gets its own adapters back
        p.data = s
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_lora_falls_back_to_peft_when_adapters_are_disabled(tiny_qlora):
    model = tiny_qlora
    batch = _batch(model.get_base_model().config.vocab_size)
    with torch.no_grad():
        with model.disable_adapter():
            ref = model(input_ids=batch["input_ids"]).logits
        patch = apply_kernels(model, ["lora_nf4"])
        try:
            with model.disable_adapter():
                got = model(input_ids=batch["input_ids"]).logits
            adapted = model(input_ids=batch["input_ids"]).logits
        finally:
            patch.undo()
    assert torch.equal(got, ref)
    assert not torch.allclose(adapted, ref)  # the adapter is active again and moves the output


def test_a_kept_traceback_does_not_keep_a_patched_model_alive():
    """An error raised inside patched forwards, kept with its traceback (as Prefect keeps a failed attempt's
    OOM while the task retries): once the model and its patch are dropped the model is freed. The H100 run
    kept a 1B model on the GPU this way: frames -> patched forward -> its closure -> the module."""
    import gc
    import traceback
    import weakref

    model = build_model("llama", 128, num_hidden_layers=1).train()
    patch = apply_kernels(model, ["rms_norm", "rope", "swiglu", "fused_linear_ce"])
    assert patch.modules["rope"] == patch.modules["fused_linear_ce"] == 1  # the model's own forward is patched
    batch = _batch(128)
    # q_proj runs inside the attention forward the rope patch replaced: the traceback goes through it
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("out of memory")))
    del q_proj
    with pytest.raises(RuntimeError) as info:
        model(**batch)
    kept = info.value
    traceback.clear_frames(kept.__traceback__)  # what the guard does before Prefect keeps the error
    alive = weakref.ref(model)
    del model, patch, info
    gc.collect()
    assert kept.__traceback__ is not None and alive() is None


def test_a_kept_traceback_does_not_keep_a_patched_qlora_model_alive(tmp_path):
    """The same through lora_nf4, whose bulk adapter casts wrap the model's own forward. As forward hooks on the
    model they kept it alive: Module.__call__ then runs the forward from a closure over the module, and the
    traceback keeps that closure (the H100 OOM-recovery test found it)."""
    import gc
    import traceback
    import weakref

    model = _qlora(save_tiny(tmp_path / "llama", "llama", num_hidden_layers=1), "llama")
    patch = apply_kernels(model, ["rope", "fused_linear_ce", "lora_nf4"])
    assert patch.modules["lora_nf4"] == len(LORA_TARGETS)
    batch = _batch(model.get_base_model().config.vocab_size)
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("out of memory")))
    del q_proj
    with pytest.raises(RuntimeError) as info:
        model(**batch)
    kept = info.value
    traceback.clear_frames(kept.__traceback__)
    alive = weakref.ref(model)
    del model, patch, info
    gc.collect()
    assert kept.__traceback__ is not None and alive() is None


def test_without_grad_the_kernels_skip_autograd_and_compute_the_same(monkeypatch):
    """Without grad (the first pass of an "unsloth" layer, evaluation) a kernel's Function forward is called
    directly, not through `Function.apply`; the values are those of the recorded call, and nothing is recorded."""
    from slimtune.kernels import rms_norm, rope, swiglu

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    cos, sin = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    calls = {
        "rms_norm": lambda: rms_norm.rms_norm(x, w, 1e-6),
        "swiglu": lambda: swiglu.swiglu(x * 1.0, x * 2.0),
        "rope": lambda: rope.rope_(x * 1.0, x * 2.0, cos, sin)[0],
    }
    recorded = {name: call() for name, call in calls.items()}
    for cls in (rms_norm._RMSNormFn, swiglu._GatedFn, rope._RopeFn):
        monkeypatch.setattr(cls, "apply", None)  # any use of autograd's path now fails
    for name, call in calls.items():
        with torch.no_grad():
            out = call()
        assert out.grad_fn is None and not out.requires_grad, name
        torch.testing.assert_close(out, recorded[name].detach(), rtol=0, atol=0, msg=name)
    q = x.detach().clone()
    version = q._version
    with torch.no_grad():
        rope.rope_(q, q.clone(), cos, sin)
    assert q._version > version  # rotated in place, and marked so, as autograd's path marks it
