"""Gradient checkpointing modes: exact LoRA gradients in every mode and family, a clean undo, training,
clear errors, the pageable fallback; on a GPU, that offloading really moves memory to the host."""

from __future__ import annotations

import logging

import pytest
import torch
from expert_lora import with_expert_lora
from peft import LoraConfig, get_peft_model
from torch import nn

from slimtune.models.families import FAMILIES
from slimtune.models.family_configs import linear_attention_layers
from slimtune.models.lora_targets import lora_target_modules
from slimtune.models.tiny import build_model
from slimtune.train.step.checkpointing import _enable, enable_checkpointing, parameters_from_lists, stored_layers

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_VOCAB = 128
# The recompute replays the same ops on the same inputs, so fp32 gradients agree to rounding at worst.
_REL_TOL = 1e-6


def _lora_model(family: str, dropout: float = 0.0, device: str = "cpu", **overrides) -> nn.Module:
    base = build_model(family, _VOCAB, **overrides).to(device)
    # init_lora_weights=False makes B random too, so every LoRA gradient (A included) is non-zero.
    targets = lora_target_modules(family, _TARGETS)  # Phi-3: qkv_proj, gate_up_proj
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    with_expert_lora(model, family, _TARGETS, r=8, alpha=16, dropout=dropout, random_b=torch.Generator().manual_seed(0))
    model.train()
    return model


def _batch(seed: int = 0, batch: int = 2, seq: int = 16, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, _VOCAB, (batch, seq), generator=g).to(device)


def _grads(model: nn.Module, ids: torch.Tensor, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the same dropout masks in every mode
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def _grads_with(model: nn.Module, mode, ids: torch.Tensor, seed: int = 1, **private) -> dict[str, torch.Tensor]:
    with _enable(model, mode, **private):
        return _grads(model, ids, seed)


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_grads_equal_across_modes_with_dropout(family: str) -> None:
    model = _lora_model(family, dropout=0.1)
    ids = _batch()
    ref = _grads_with(model, False, ids)
    # layers x projections x (A, B): layer 0 too, with frozen embeddings (Gemma 3: 6 layers; Phi-3: 4 fused)
    row = FAMILIES[family]
    layers = row.tiny.get("num_hidden_layers", 4)
    adapted = layers * len(row.lora_targets)
    if row.experts:  # gate and up of every expert are one LoRA pair (NF4Experts' gate_up)
        adapted -= layers
    if row.linear_attention_targets:  # Qwen3.5: the DeltaNet's projections instead of q/k/v/o on its linear layers
        linear = sum(linear_attention_layers({"num_hidden_layers": layers}))
        adapted -= (layers - linear) * len(row.linear_attention_targets) + linear * 4
    assert len(ref) == adapted * 2
    assert all(g.abs().sum() > 0 for g in ref.values())
    assert _max_rel_diff(_grads_with(model, True, ids), ref) <= _REL_TOL
    assert _max_rel_diff(_grads_with(model, "unsloth", ids), ref) <= _REL_TOL
    # The full offload bookkeeping (host buffers, prefetch links) on CPU: threshold 0 offloads every layer.
    offloaded = _grads_with(model, "unsloth", ids, offload_min_bytes=0, offload_on_cpu=True)
    assert _max_rel_diff(offloaded, ref) <= _REL_TOL
    # Dropout really is in play: another seed draws other masks, moving the gradients far past the tolerance.
    assert _max_rel_diff(_grads_with(model, "unsloth", ids, seed=2), ref) > 1e-3


def test_unsloth_matches_standard_under_autocast() -> None:
    """Autocast is thread-local; the recompute must run under the forward's autocast state."""
    model = _lora_model("llama", dropout=0.1)
    ids = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads_with(model, True, ids)
        ours = _grads_with(model, "unsloth", ids, offload_min_bytes=0, offload_on_cpu=True)
    assert _max_rel_diff(ours, ref) <= _REL_TOL


def _quantize_nf4(model: nn.Module) -> None:
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name != "lm_head":
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=False,
                    compute_dtype=torch.float32,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4", module=q)
                q.weight._quantize(child.weight.device)
                q.quant_state = q.weight.quant_state
                setattr(module, name, q)
    model.is_loaded_in_4bit = True  # peft dispatches its bitsandbytes LoRA layers on this flag


def test_nf4_lora_grads_equal() -> None:
    import peft.tuners.lora.bnb as lora_bnb

    base = build_model("llama", _VOCAB)
    _quantize_nf4(base)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=_TARGETS, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    model.train()
    assert isinstance(model.base_model.model.model.layers[0].mlp.down_proj, lora_bnb.Linear4bit)
    ids = _batch()
    ref = _grads_with(model, False, ids)
    ours = _grads_with(model, "unsloth", ids, offload_min_bytes=0, offload_on_cpu=True)
    assert _max_rel_diff(ours, ref) <= _REL_TOL


@pytest.mark.parametrize("mode", [True, "unsloth"])
def test_undo_restores_structure_and_outputs(mode) -> None:
    model = _lora_model("gemma")
    base = model.get_base_model()
    base.config.use_cache = True
    # transformers' own flag, as peft's prepare_model_for_kbit_training leaves it: switched off while we run.
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = base.model.layers
    ids = _batch()
    before_repr, before_keys = repr(model), list(model.state_dict())
    before_dicts = [dict(layer.__dict__) for layer in layers]
    model.eval()
    with torch.no_grad():
        before_out = model(input_ids=ids).logits

    handle = enable_checkpointing(model, mode)
    assert handle.mode == mode and not handle.offloading  # CPU: no offload
    assert base.config.use_cache is False
    assert all(layer.gradient_checkpointing is False for layer in layers)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before_out)  # eval bypasses the recompute path
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    handle.undo()
    handle.undo()  # idempotent

    assert repr(model) == before_repr and list(model.state_dict()) == before_keys
    assert [dict(layer.__dict__) for layer in layers] == before_dicts
    assert base.config.use_cache is True
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before_out)


def test_listed_parameters_give_the_same_gradients_without_walking_the_layers() -> None:
    """Inside `parameters_from_lists` a checkpointed layer hands the recompute the list made on entry; its
    own `parameters()` walk runs again once the block is left, also after an error."""
    model = _lora_model("llama")
    ids = _batch()
    ref = _grads_with(model, False, ids)
    layer = model.get_base_model().model.layers[0]
    walks = []
    cls_parameters = type(layer).parameters

    def counting(recurse: bool = True):
        walks.append(recurse)
        return cls_parameters(layer, recurse)

    layer.parameters = counting  # this one instance: counts the layer's own walks
    with enable_checkpointing(model, "unsloth"):
        with parameters_from_lists(model) as listed:
            assert listed == len(model.get_base_model().model.layers)
            walks.clear()
            assert _max_rel_diff(_grads(model, ids), ref) <= _REL_TOL
            assert walks == []
        assert _max_rel_diff(_grads(model, ids), ref) <= _REL_TOL
        assert walks  # the walk is back
        with pytest.raises(RuntimeError, match="inside"), parameters_from_lists(model):
            raise RuntimeError("inside")
        walks.clear()
        _grads(model, ids)
        assert walks
    with parameters_from_lists(model) as listed:  # nothing checkpointed: nothing listed
        assert listed == 0


@pytest.mark.parametrize("mode", [True, "unsloth"])
def test_stored_layers_skip_their_recompute_and_give_the_same_gradients(mode) -> None:
    """Inside `stored_layers(model, n)` the last n checkpointed layers run once per step and autograd keeps their
    activations; the others run again in the backward; the gradients equal those without checkpointing."""
    model = _lora_model("llama")
    layers = model.get_base_model().model.layers
    ids = _batch()
    ref = _grads_with(model, False, ids)
    runs: list[int] = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_, i=i: runs.append(i)) for i, layer in enumerate(layers)]
    saved: list[int] = []

    def step() -> dict[str, torch.Tensor]:
        """The gradients of one step; `saved`: what the forward kept for the backward (bytes per tensor)."""
        runs.clear()
        saved.clear()
        pack = lambda t: saved.append(t.numel() * t.element_size()) or t  # noqa: E731
        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return grads

    with enable_checkpointing(model, mode):
        assert _max_rel_diff(step(), ref) <= _REL_TOL
        assert [runs.count(i) for i in range(len(layers))] == [2] * len(layers)
        recomputed_saved = sum(saved)
        with stored_layers(model, 1) as n:
            assert n == 1
            assert _max_rel_diff(step(), ref) <= _REL_TOL
            assert [runs.count(i) for i in range(len(layers))] == [2] * (len(layers) - 1) + [1]
            assert sum(saved) > 1.5 * recomputed_saved  # the stored layer's activations, kept until its backward
        with stored_layers(model, 99) as n:  # more than there are: every layer
            assert n == len(layers)
            assert _max_rel_diff(step(), ref) <= _REL_TOL
            assert runs == list(range(len(layers)))
        with pytest.raises(RuntimeError, match="inside"), stored_layers(model, 2):
            raise RuntimeError("inside")
        step()  # the block is left, also after an error: every layer is recomputed again
        assert [runs.count(i) for i in range(len(layers))] == [2] * len(layers)
    for hook in hooks:
        hook.remove()
    with stored_layers(model, 2) as n:  # nothing checkpointed: nothing to store
        assert n == 0


def test_unsloth_trains() -> None:
    model = _lora_model("qwen3")
    ids = _batch(batch=4, seq=24)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    with enable_checkpointing(model, "unsloth"):
        for _ in range(6):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses


def test_unsupported_model_names_the_architecture() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: Llama"):
        enable_checkpointing(model, "unsloth")


def test_bad_mode_and_double_enable_are_refused() -> None:
    model = _lora_model("llama")
    with pytest.raises(ValueError, match='lora.gradient_checkpointing must be false, true or "unsloth"'):
        enable_checkpointing(model, "offload")  # type: ignore[arg-type]
    with enable_checkpointing(model, True):
        with pytest.raises(ValueError, match="already enabled"):
            enable_checkpointing(model, "unsloth")
    enable_checkpointing(model, "unsloth").undo()  # allowed again once undone
    handle = enable_checkpointing(model, True)
    layer = model.get_base_model().model.layers[2]
    ours = layer.forward
    layer.forward = lambda *a, **k: ours(*a, **k)  # another patch on top of ours
    with pytest.raises(RuntimeError, match="decoder layer 2's forward was replaced"):
        handle.undo()
    layer.forward = ours  # the other patch comes off first; then ours can
    handle.undo()
    assert all("forward" not in layer.__dict__ for layer in model.get_base_model().model.layers)


def test_extra_inputs_needing_grad_are_refused() -> None:
    model = _lora_model("llama")
    layer = model.get_base_model().model.layers[0]
    hidden = torch.randn(1, 4, 256)
    cos, sin = torch.ones(1, 4, 64, requires_grad=True), torch.zeros(1, 4, 64)
    with enable_checkpointing(model, "unsloth"):
        with pytest.raises(ValueError, match="position_embeddings requires grad"):
            layer(hidden, position_embeddings=(cos, sin), attention_mask=None)


def test_hidden_states_by_keyword_matches_the_plain_layer() -> None:
    model = _lora_model("qwen2", dropout=0.1)
    layer = model.get_base_model().model.layers[1]
    hidden = torch.randn(2, 8, 256, requires_grad=True)
    rope = (torch.randn(2, 8, 64), torch.randn(2, 8, 64))
    results = []
    for mode in (False, "unsloth"):
        with enable_checkpointing(model, mode):
            torch.manual_seed(3)
            out = layer(hidden_states=hidden, position_embeddings=rope, attention_mask=None, use_cache=True)
            (grad,) = torch.autograd.grad(out.square().sum(), hidden)
            results.append((out.detach(), grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.allclose(results[0][1], results[1][1], rtol=_REL_TOL, atol=0)


def test_host_buffers_reused_and_pageable_fallback_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """On a CPU-only torch, pinned allocation fails as it does on WSL: one log line, pageable memory."""
    model = _lora_model("mistral")
    ids = _batch()
    caplog.set_level(logging.WARNING, logger="slimtune.train.step.offload")
    with _enable(model, "unsloth", offload_min_bytes=0, offload_on_cpu=True) as handle:
        _grads(model, ids)
        first = handle.stats()
        _grads(model, ids)
        second = handle.stats()
    layer_bytes = 2 * 16 * 256 * 4  # batch x seq x hidden x fp32
    assert first.offloaded_bytes_per_step == 3 * layer_bytes  # every layer but the last
    assert second.host_buffer_bytes == first.host_buffer_bytes == 3 * layer_bytes  # allocated once
    fallback = not torch.cuda.is_available()
    assert second.pageable_fallback is fallback
    assert len([r for r in caplog.records if "pinned host memory" in r.getMessage()]) == int(fallback)


# ---------------------------------------------------------------- GPU (run through the device tool)
# Eager attention: fused attention backward kernels may accumulate with atomics (run-to-run noise),
# which would blur an exactness check; eager is plain matmul + softmax.
_MEDIUM = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    attn_implementation="eager",
)


def _peak_and_grads(model: nn.Module, mode, ids: torch.Tensor):
    with enable_checkpointing(model, mode) as handle:
        _grads(model, ids)  # warm-up: allocates the host buffers
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        grads = _grads(model, ids)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, grads, handle.offloading, handle.stats()


@pytest.mark.gpu
def test_gpu_offload_moves_layer_inputs_to_host() -> None:
    model = _lora_model("llama", dropout=0.1, device="cuda", **_MEDIUM)
    ids = _batch(batch=4, seq=1024, device="cuda")
    layer_bytes = 4 * 1024 * 1024 * 4  # batch x seq x hidden x fp32 = 16 MiB
    peak_std, ref, _, _ = _peak_and_grads(model, True, ids)
    peak_ours, ours, offloading, stats = _peak_and_grads(model, "unsloth", ids)
    assert offloading
    assert stats.offloaded_bytes_per_step == 15 * layer_bytes  # all but the last of 16 layers
    assert stats.host_buffer_bytes >= 15 * layer_bytes
    # Standard checkpointing keeps 16 inputs on the GPU; ours keeps the last one plus about two in flight.
    assert peak_ours <= peak_std - 10 * layer_bytes, (peak_ours, peak_std)
    # Same kernels on the same inputs; 1e-5 leaves room for cuBLAS picking other algorithms per call.
    assert _max_rel_diff(ours, ref) <= 1e-5


@pytest.mark.gpu
def test_gpu_offload_exact_under_bf16_autocast() -> None:
    model = _lora_model("qwen2", dropout=0.1, device="cuda", **_MEDIUM)
    ids = _batch(batch=2, seq=512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = _grads_with(model, True, ids)
        ours = _grads_with(model, "unsloth", ids)
    # A recompute outside autocast would run in fp32 against bf16 forward values and miss by ~1e-2 or fail
    # outright; 1e-3 still leaves room for bf16 rounding noise between two runs of the same kernels.
    assert _max_rel_diff(ours, ref) <= 1e-3
