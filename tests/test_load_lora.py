"""load_4bit and attach_lora on every supported family, and the errors for what we cannot load."""

import json
import shutil

import bitsandbytes as bnb
import pytest
import torch

from slimtune.core import registry
from slimtune.models.experts import HELD
from slimtune.models.families import FAMILIES
from slimtune.models.family_configs import linear_attention_layers
from slimtune.models.source import ModelSourceError, check_model_dir
from slimtune.models.tiny import save_tiny
from slimtune.spec.schema import ModelSpec, PipelineSpec
from slimtune.tasks.attach_lora import attach_lora
from slimtune.tasks.load_4bit import load_4bit


@pytest.fixture(autouse=True)
def _empty_registry():
    yield
    registry.release_all()


def _spec(path, **lora) -> PipelineSpec:
    spec = PipelineSpec()
    spec.model = ModelSpec(name_or_path=str(path), device="cpu")
    for key, value in lora.items():
        setattr(spec.lora, key, value)
    return spec


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_in_nf4_and_trains(family, tmp_path):
    model_dir = save_tiny(tmp_path / family, family)
    spec = _spec(model_dir, gradient_checkpointing="unsloth", dropout=0.0)
    loaded = load_4bit(spec)
    model = registry.get(loaded.handle)
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    row = FAMILIES[family]
    held = {n for names in HELD.values() for n in names} if row.experts else set()  # an MoE's MLP: 3-D experts
    per_layer = len(set(row.lora_targets) - held)  # 7 projections, 4 where q/k/v and gate/up are fused (phi3)
    per_layer += len(FAMILIES[family].frozen_linears)  # Gemma 4's per-layer input gate and projection
    model_level = family == "gemma4_text"  # Gemma 4's per-layer input projection
    n_linears = per_layer * model.config.num_hidden_layers + model_level
    if deltanet := FAMILIES[family].linear_attention_targets:  # Qwen3.5: its projections instead of q/k/v/o there
        linear = sum(linear_attention_layers(model.config.to_dict()))
        n_linears -= (model.config.num_hidden_layers - linear) * len(deltanet) + linear * 4
    assert loaded.linear_4bit == len(linears) == n_linears  # lm_head stays 16-bit
    assert linears[0].weight.quant_state.nested  # double quantization
    assert linears[0].weight.quant_type == "nf4"
    lora = attach_lora(spec, loaded.handle)
    experts = [f"experts.{p}_proj" for p in HELD] if row.experts else []  # NF4Experts' own LoRA
    assert lora.target_modules == sorted([*set(row.lora_targets) - held, *experts])  # the spec's default names
    peft_model = registry.get(lora.handle)
    assert lora.trainable_parameters == sum(p.numel() for p in peft_model.parameters() if p.requires_grad) > 0
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    blocks = [m for m in peft_model.modules() if type(m).__name__ == "NF4Experts"]
    assert len(blocks) == (model.config.num_hidden_layers if row.experts else 0)
    assert all(b.lora_projections() == list(HELD) for b in blocks)
    ids = torch.randint(0, 800, (2, 24))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_attach_lora_applies_the_spec_kernels(tmp_path):
    """train.kernels reaches the model in the pipeline: auto on a CPU picks none (and says why); named
    kernels run under the Triton interpreter the tests set up."""
    model_dir = save_tiny(tmp_path / "m", "llama")
    spec = _spec(model_dir, gradient_checkpointing="unsloth", dropout=0.0)
    auto = attach_lora(spec, load_4bit(spec).handle)
    assert auto.kernels == {} and "no CUDA device" in auto.kernels_skipped["rms_norm"]
    registry.release_all()

    spec.train.kernels = ["rms_norm", "swiglu", "lora_nf4"]
    lora = attach_lora(spec, load_4bit(spec).handle)
    assert lora.kernels == {"rms_norm": 9, "swiglu": 4, "lora_nf4": 28}, lora.kernels_skipped
    peft_model = registry.get(lora.handle)
    ids = torch.randint(0, 800, (2, 16))
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in peft_model.parameters() if p.requires_grad)
    registry.release_all()

    spec.train.kernels, spec.train.num_gpus = ["host_embedding"], 2  # a DDP worker's spec
    ddp = attach_lora(spec, load_4bit(spec).handle)
    assert ddp.kernels == {} and "DDP" in ddp.kernels_skipped["host_embedding"]


def test_rslora_all_linear_and_bias_options(tmp_path):
    model_dir = save_tiny(tmp_path / "m", "llama")
    spec = _spec(
        model_dir,
        target_modules="all-linear",
        use_rslora=True,
        r=8,
        alpha=16,
        bias="lora_only",
        gradient_checkpointing=False,
    )
    lora = attach_lora(spec, load_4bit(spec).handle)
    config = registry.get(lora.handle).peft_config["default"]
    assert config.use_rslora and config.r == 8
    assert set(lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_train_embeddings_keeps_trainable_copies_and_offloads_originals(tmp_path):
    model_dir = save_tiny(tmp_path / "m", "llama")
    spec = _spec(model_dir, train_embeddings=True, gradient_checkpointing=False)
    lora = attach_lora(spec, load_4bit(spec).handle)
    model = registry.get(lora.handle)
    wrapped = [
        m for n, m in model.named_modules() if n.endswith(("embed_tokens", "lm_head")) and hasattr(m, "original_module")
    ]
    assert len(wrapped) == 2
    for m in wrapped:
        assert all(p.device.type == "cpu" and not p.requires_grad for p in m.original_module.parameters())
        assert all(p.requires_grad and p.dtype == torch.float32 for p in m.modules_to_save.parameters())


def test_tied_embeddings_cannot_be_trained_separately(tmp_path):
    model_dir = save_tiny(tmp_path / "g", "gemma")
    spec = _spec(model_dir, train_embeddings=True)
    with pytest.raises(ValueError, match="lora.train_embeddings"):
        attach_lora(spec, load_4bit(spec).handle)


def test_unsupported_architecture_is_refused_before_loading(tmp_path):
    model_dir = save_tiny(tmp_path / "m", "llama")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match="architecture 'gpt_neox' .* not supported; slimtune supports llama"):
        load_4bit(_spec(model_dir))


def test_pickle_weights_need_explicit_opt_in(tmp_path):
    model_dir = save_tiny(tmp_path / "m", "llama")
    from safetensors.torch import load_file

    torch.save(load_file(model_dir / "model.safetensors"), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="model.allow_pickle"):
        check_model_dir(ModelSpec(name_or_path=str(model_dir)), model_dir)
    spec = _spec(model_dir)
    spec.model.allow_pickle = True
    assert load_4bit(spec).linear_4bit == 28


def test_missing_config_and_merged_models_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match="no config.json"):
        check_model_dir(ModelSpec(name_or_path=str(empty)), empty)
    model_dir = save_tiny(tmp_path / "m", "llama")
    merged = tmp_path / "merged"
    shutil.copytree(model_dir, merged)
    cfg = json.loads((merged / "config.json").read_text())
    cfg["slimtune_merged"] = {"adapter": "abc"}
    (merged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSourceError, match="already merged"):
        check_model_dir(ModelSpec(name_or_path=str(merged)), merged)


def test_gpu_requested_without_gpu_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = _spec(save_tiny(tmp_path / "m", "llama"))
    spec.model.device = "cuda"
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible; use model.device: cpu"):
        load_4bit(spec)


def test_a_retry_after_out_of_memory_attaches_one_adapter(tmp_path, monkeypatch, recwarn):
    import slimtune.tasks.attach_lora as attach_lora_mod

    spec = _spec(save_tiny(tmp_path / "llama", "llama"))
    loaded = load_4bit(spec)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected after peft injected the LoRA layers)")

    with monkeypatch.context() as mp:
        mp.setattr(attach_lora_mod, "enable_checkpointing", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            attach_lora(spec, loaded.handle)
    base = registry.get(loaded.handle)  # what the retry gets: the base model as load_4bit left it
    assert not hasattr(base, "peft_config") and not [n for n, _ in base.named_modules() if "lora_" in n]
    lora = attach_lora(spec, loaded.handle)
    peft_warnings = [str(w.message) for w in recwarn if "adapter" in str(w.message) or "second time" in str(w.message)]
    assert peft_warnings == []
    peft_model = registry.get(lora.handle)
    assert list(peft_model.peft_config) == ["default"]
    lora_a = [n for n, _ in peft_model.named_modules() if n.endswith("lora_A.default")]
    assert len(lora_a) == len(FAMILIES["llama"].lora_targets) * peft_model.config.num_hidden_layers
