"""slimtune.merge: exactness against peft for both sources, spill, disk errors, reuse and refusals (CPU)."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest
import torch
from expert_lora import with_expert_lora
from safetensors.torch import load_file, save_file

from slimtune.kernels.nf4_experts import NF4Experts, load_expert_lora, quantize_model_experts
from slimtune.merge import AdapterMismatchError, AlreadyMergedError, DiskSpaceError, merge_adapter, safetensors_io
from slimtune.merge.nf4 import QuantSpec, quantized_tensor_names, roundtrip
from slimtune.models.experts import per_expert_name
from slimtune.models.families import FAMILIES
from slimtune.models.family_configs import linear_attention_layers
from slimtune.models.lora_targets import lora_target_modules
from slimtune.models.tiny import build_model, build_tokenizer
from slimtune.train.adapter_io import add_expert_lora

SMALL_SHARDS = 3_000_000  # the tiny fp32 models are ~11 MB: four shards, so shard boundaries are exercised


def _nf4_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )


def _linears(family: str) -> int:
    """Linears of the tiny model (7 a layer; 4 in Phi-3, whose q/k/v and gate/up are fused; Qwen3.5's linear-
    attention layers have their DeltaNet projections instead of q/k/v/o), all adapted."""
    row = FAMILIES[family]
    layers = row.tiny.get("num_hidden_layers", 4)
    linear = sum(linear_attention_layers({"num_hidden_layers": layers})) if row.linear_attention_targets else 0
    attention = len(row.lora_targets) - len(row.linear_attention_targets)  # q/k/v/o and the MLP
    if row.fused_experts:  # gpt-oss's MLP: two stacked tensors (gate_up, down) that hold every expert
        attention -= 1
    elif row.experts:  # an MoE's MLP: gate, up and down of every expert, stored apart
        attention += 3 * (row.tiny["num_experts"] - 1)
    return (layers - linear) * attention + linear * (attention - 4 + len(row.linear_attention_targets))


def _stacked_expert_factors(
    ab: dict[str, torch.Tensor], module: str, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, B) stacked over experts where the adapter holds per-expert LoRA on the stacked tensor `module` (gpt-oss's
    `<block>.<e>.gate_up_proj`), else None."""
    block, _, projection = module.rpartition(".")
    keys = [f"{block}.{e}.{projection}.lora_{{}}.weight" for e in range(w.shape[0])] if w.dim() == 3 else []
    if not keys or keys[0].format("A") not in ab:
        return None
    return torch.stack([ab[k.format("A")] for k in keys]), torch.stack([ab[k.format("B")] for k in keys])


def _save_adapter(base: Path, out: Path, seed: int, **lora) -> Path:
    """A LoRA on every projection with random (non-zero) B, so merging really changes the weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    family = model.config.model_type
    targets = list(FAMILIES[family].lora_targets)
    peft_targets = lora_target_modules(family, targets)  # an MoE's MLP names are its experts': not peft's
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=peft_targets, **lora))
    g = torch.Generator().manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    with_expert_lora(model, family, targets, r=8, alpha=16, random_b=g)  # dense families: nothing
    peft_model.save_pretrained(out)
    add_expert_lora(out, peft_model)  # an MoE's expert LoRA, per expert, as training saves it
    return out


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{family: (base_dir, adapter_dir)} for every family's tiny model (biases, tied embeddings, fused
    projections, post-norms: whatever the family has)."""
    root = tmp_path_factory.mktemp("merge_models")
    tok = build_tokenizer()  # trained once (~5 s): save_tiny would retrain it per family
    out = {}
    for i, family in enumerate(FAMILIES):
        base = root / family
        build_model(family, len(tok)).save_pretrained(base)
        tok.save_pretrained(base)
        out[family] = (base, _save_adapter(base, root / f"{family}-adapter", seed=i))
    return out


@pytest.fixture
def nf4_models(models):
    """The NF4 base as training loads it (compute dtype fp32), loaded fresh in each test.

    Not shared across tests: a forward pass mutates the model. On a CPU with AVX512-BF16, bitsandbytes
    0.50 repacks an eval-mode Linear4bit on its first no-grad forward for its CPU inference kernel, with
    the absmax cast to bfloat16; a later `save_pretrained` re-quantizes that absmax, so the saved bytes
    depend on which test ran first. `support_avx512bf16_for_cpu = False` (an attribute of each module, the
    switch bitsandbytes reads) keeps the exact fp32 dequantization that training and our merge use: with
    the bf16 repacking, peft's logits were 1.1e-2 from our merge's (96% of them beyond 1e-4, llama and
    qwen2); without it the two agree to 1.6e-6.
    """
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    def get(family: str):
        model = AutoModelForCausalLM.from_pretrained(
            models[family][0], quantization_config=_nf4_config(), dtype=torch.float32
        ).eval()
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.support_avx512bf16_for_cpu = False
        quantize_model_experts(model, torch.float32)  # an MoE's experts, as load_4bit quantizes them
        return model

    return get


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / shard))
    assert set(out) == set(index["weight_map"])
    return out


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _leftovers(parent: Path) -> list[str]:
    marks = (".tmp-", ".old-", ".slimtune-spill-")
    return [p.name for p in parent.iterdir() if any(m in p.name for m in marks)]


@pytest.mark.parametrize("family", FAMILIES)
def test_original_is_exact_w_plus_scaled_ba(models, tmp_path, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, adapter = models[family]
    report = merge_adapter(
        base, adapter, tmp_path / "out", source="auto", output_dtype=torch.float32, max_shard_bytes=SMALL_SHARDS
    )
    assert report.source_used == "original" and not report.reused
    assert report.tensors_merged == _linears(family) and report.shards > 1
    before, after = load_file(base / "model.safetensors"), _tensors(tmp_path / "out")
    assert set(before) == set(after)
    ab = load_file(adapter / "adapter_model.safetensors")
    scale = 16 / 8  # lora_alpha / r
    targets = 0
    for name, w in before.items():
        module = "base_model.model." + name.removesuffix(".weight")
        stacked = _stacked_expert_factors(ab, module, w)
        if f"{module}.lora_A.weight" in ab or stacked:
            targets += 1
            if stacked:  # gpt-oss's fused [E, in, out] tensor: each expert's (B A)^T
                expected = w + scale * (stacked[1] @ stacked[0]).transpose(-2, -1)
            else:
                a, b = ab[f"{module}.lora_A.weight"], ab[f"{module}.lora_B.weight"]
                expected = w + scale * (b @ a)
            assert torch.equal(after[name], expected), name  # exact: same fp32 ops as peft's merge
            assert not torch.equal(after[name], w), name  # the adapter is not the identity
        else:
            assert after[name].numpy().tobytes() == w.numpy().tobytes(), name  # unchanged by merging
    assert targets == _linears(family) and not any(torch.isnan(t).any() for t in after.values())

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["slimtune_merged"]["source"] == "original"
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("hello world").input_ids == AutoTokenizer.from_pretrained(base)("hello world").input_ids
    assert (tmp_path / "out" / "generation_config.json").is_file()
    # every family has an attention layer with o_proj (Qwen3.5's first is DeltaNet, its fourth attention)
    i = next(i for i, layer in enumerate(merged.model.layers) if hasattr(layer, "self_attn"))
    o = f"model.layers.{i}.self_attn.o_proj.weight"
    assert torch.equal(merged.model.layers[i].self_attn.o_proj.weight, after[o])
    assert _leftovers(tmp_path) == []


def test_bf16_output_casts_the_fp32_merge(models, tmp_path):
    base, adapter = models["llama"]
    merge_adapter(base, adapter, tmp_path / "out", source="original", output_dtype=torch.bfloat16)
    after = _tensors(tmp_path / "out")
    w = load_file(base / "model.safetensors")["model.layers.2.mlp.down_proj.weight"]
    ab = load_file(adapter / "adapter_model.safetensors")
    a = ab["base_model.model.model.layers.2.mlp.down_proj.lora_A.weight"]
    b = ab["base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"]
    assert after["model.layers.2.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(after["model.layers.2.mlp.down_proj.weight"], (w + 2.0 * (b @ a)).to(torch.bfloat16))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", FAMILIES)
def test_nf4_roundtrip_matches_what_from_pretrained_holds(models, nf4_models, family):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    base, _ = models[family]
    model = nf4_models(family)
    stored = load_file(base / "model.safetensors")
    linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    for block, m in model.named_modules():  # each expert's stored matrices, as NF4Experts holds them
        if isinstance(m, NF4Experts) and m.transposed:  # gpt-oss: the stored stacks, each expert quantized alone
            linears |= {f"{block}.{p}_proj": (getattr(m, p), None) for p in ("gate_up", "down")}
        elif isinstance(m, NF4Experts):
            parts = dict(zip(("gate_proj", "up_proj"), m.gate_up.parts)) | {"down_proj": m.down}
            linears |= {per_expert_name(block, e, p): (w, e) for p, w in parts.items() for e in range(m.num_experts)}
    # Gemma 4's per-layer input gate and projection and its model-level per-layer input projection are NF4 too
    frozen = len(FAMILIES[family].frozen_linears) * FAMILIES[family].tiny.get("num_hidden_layers", 4)
    frozen += family == "gemma4_text"
    assert quantized_tensor_names(base, QuantSpec()) == set(linears) and len(linears) == _linears(family) + frozen
    for name, module in linears.items():
        if isinstance(module, tuple):  # an expert's matrix in NF4ExpertWeights
            weights, e = module
            experts = range(weights.num_experts) if e is None else None
            loaded = (
                weights.dequantize_experts(e, e + 1)[0]
                if experts is None
                else torch.stack([weights.dequantize_experts(i, i + 1)[0] for i in experts])
            )
        else:
            loaded = bf.dequantize_4bit(module.weight.data, module.weight.quant_state)
        ours = roundtrip(stored[name], QuantSpec())
        assert torch.equal(ours, loaded), name  # bit-identical: the weights the adapter was trained against
        assert not torch.equal(ours, stored[name])  # and really quantized


@pytest.mark.parametrize("family", FAMILIES)
def test_dequantized_logits_match_peft_on_the_nf4_base(models, nf4_models, tmp_path, family):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = models[family]
    report = merge_adapter(base, adapter, tmp_path / "out", source="dequantized", output_dtype=torch.float32)
    assert report.source_used == "dequantized" and report.tensors_merged == _linears(family)
    nf4 = nf4_models(family)
    ids = torch.randint(0, nf4.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    unscale = getattr(nf4.config, "logits_scaling", 1.0)  # Granite divides its logits by 16: undone here
    with torch.no_grad():
        base_logits = nf4(ids).logits * unscale
        with_expert_lora(nf4, family, list(FAMILIES[family].lora_targets), r=8, alpha=16)
        peft_model = PeftModel.from_pretrained(nf4, adapter).eval()
        load_expert_lora(peft_model, load_file(adapter / "adapter_model.safetensors"))  # peft's load skips these
        peft_logits = peft_model(ids).logits * unscale
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        merged_logits = merged(ids).logits * unscale
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapter moves the output
    # The merged fp32 model against peft on the NF4 base that training saw, both on the exact fp32
    # dequantization. 1e-4: fp32 reassociation of x@W^T + s*(x@A^T)@B^T versus x@(W + s*B@A)^T (measured
    # 1.6e-6); logits are O(1).
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-4, rtol=0)


def test_auto_on_a_4bit_checkpoint_merges_its_stored_nf4(models, nf4_models, tmp_path):
    from transformers import AutoModelForCausalLM

    from slimtune.merge import MergeError

    base, adapter = models["llama"]
    nf4_models("llama").save_pretrained(tmp_path / "bnb4")  # packed uint8 weights + absmax/quant_map/...
    auto = merge_adapter(tmp_path / "bnb4", adapter, tmp_path / "auto", source="auto", output_dtype=torch.float32)
    assert auto.source_used == "dequantized" and auto.tensors_merged == 28
    from16 = tmp_path / "from16"
    merge_adapter(base, adapter, from16, source="dequantized", output_dtype=torch.float32)
    a, b = _tensors(tmp_path / "auto"), _tensors(from16)
    assert set(a) == set(b)  # the 4-bit parts are gone; names are those of a 16-bit checkpoint
    for name in a:
        assert torch.equal(a[name], b[name]), name  # the stored NF4 is what we reproduce from 16-bit
    assert "quantization_config" not in json.loads((tmp_path / "auto" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "auto")
    assert type(merged.model.layers[0].mlp.up_proj) is torch.nn.Linear
    with pytest.raises(MergeError, match="4-bit bitsandbytes checkpoint without 16-bit shards"):
        merge_adapter(tmp_path / "bnb4", adapter, tmp_path / "original", source="original")


def test_host_budget_spills_and_output_is_byte_identical(models, tmp_path):
    base, adapter = models["llama"]
    free = merge_adapter(base, adapter, tmp_path / "free", source="original", max_shard_bytes=SMALL_SHARDS)
    spill_root = tmp_path / "spill"
    model_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    tight = merge_adapter(
        base,
        adapter,
        tmp_path / "tight",
        source="original",
        max_shard_bytes=SMALL_SHARDS,
        host_budget_bytes=model_bytes // 20,
        temporary_location=spill_root,
    )
    assert free.tensors_spilled == 0 and tight.tensors_spilled > 0 and tight.bytes_spilled > 0
    assert tight.peak_host_held_bytes <= model_bytes // 20
    a, b = _files(tmp_path / "free"), _files(tmp_path / "tight")
    a.pop("slimtune_manifest.json"), b.pop("slimtune_manifest.json")
    assert a == b  # byte-identical shards, index, config and tokenizer files
    assert list(spill_root.iterdir()) == [] and _leftovers(tmp_path) == []


def test_disk_preflight_fails_before_writing(models, tmp_path, monkeypatch):
    from slimtune.merge import budgets as plan

    base, adapter = models["llama"]
    out = tmp_path / "new" / "out"

    def little_free(path):
        return plan.shutil._ntuple_diskusage(10**12, 10**12 - 10**6, 10**6)

    monkeypatch.setattr(plan.shutil, "disk_usage", little_free)
    message = r"not enough disk space at .* need .* free .*merge.temporary_location"
    with pytest.raises(DiskSpaceError, match=message):
        merge_adapter(base, adapter, out, source="original")
    assert not (tmp_path / "new").exists()  # not even the parent directory


def test_disk_full_mid_write_leaves_nothing(models, tmp_path, monkeypatch):
    base, adapter = models["llama"]
    real_open = open

    class _FillsUp:
        """A shard file that accepts 1 MB, then fails as a full disk does."""

        def __init__(self, f):
            self._f, self._n = f, 0

        def write(self, data):
            self._n += len(data)
            if self._n > 1_000_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def fake_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return _FillsUp(f) if "w" in mode else f

    monkeypatch.setattr(safetensors_io, "open", fake_open, raising=False)
    message = r"disk full while writing .*model-00001-of-00004\.safetensors.*GiB"
    with pytest.raises(DiskSpaceError, match=message):
        merge_adapter(
            base,
            adapter,
            tmp_path / "out",
            source="original",
            max_shard_bytes=SMALL_SHARDS,
            host_budget_bytes=100_000,
            temporary_location=tmp_path / "spill",
        )
    assert not (tmp_path / "out").exists()
    assert list((tmp_path / "spill").iterdir()) == [] and _leftovers(tmp_path) == []


def test_rerun_reuses_and_corruption_is_recomputed(models, tmp_path):
    base, adapter = models["qwen2"]
    out = tmp_path / "out"
    first = merge_adapter(base, adapter, out, source="original", max_shard_bytes=SMALL_SHARDS)
    good = _files(out)
    again = merge_adapter(base, adapter, out, source="original", max_shard_bytes=SMALL_SHARDS)
    assert again.reused and again.tensors_merged == 0 and not first.reused
    shard = out / "model-00002-of-00004.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # flip one bit pattern in the last weight byte
    shard.write_bytes(bytes(data))
    fixed = merge_adapter(base, adapter, out, source="original", max_shard_bytes=SMALL_SHARDS)
    assert not fixed.reused and _files(out) == good
    (out / "model-00003-of-00004.safetensors").unlink()  # a partial output
    assert not merge_adapter(base, adapter, out, source="original", max_shard_bytes=SMALL_SHARDS).reused
    assert _files(out) == good
    other = merge_adapter(base, adapter, out, source="original", max_shard_bytes=SMALL_SHARDS // 2)
    assert not other.reused  # different parameters are a different merge
    assert _leftovers(tmp_path) == []


def test_already_merged_base_is_refused(models, tmp_path):
    base, adapter = models["llama"]
    merge_adapter(base, adapter, tmp_path / "once", source="original")
    with pytest.raises(AlreadyMergedError, match="already a merged model.*twice"):
        merge_adapter(tmp_path / "once", adapter, tmp_path / "twice", source="original")
    assert not (tmp_path / "twice").exists()


def test_shape_mismatch_is_refused_naming_tensor_and_shapes(models, tmp_path):
    base, adapter = models["llama"]
    bad = tmp_path / "bad-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key] = torch.randn(384, 8)  # as if trained on a model with intermediate_size 384
    for half in "AB":  # and a target the base does not have
        old = f"base_model.model.model.layers.3.mlp.up_proj.lora_{half}.weight"
        tensors[old.replace("layers.3", "layers.9")] = tensors.pop(old)
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(AdapterMismatchError) as err:
        merge_adapter(base, bad, tmp_path / "out", source="original")
    assert "model.layers.1.mlp.up_proj.weight: base shape (512, 256) but the LoRA delta is (384, 256)" in str(err.value)
    assert "LoRA targets model.layers.9.mlp.up_proj.weight but the base checkpoint has no such tensor" in str(err.value)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_rslora_alpha_pattern_and_modules_to_save(models, tmp_path):
    base = models["llama"][0]
    adapter = _save_adapter(
        base, tmp_path / "adapter", seed=3, use_rslora=True, alpha_pattern={"down_proj": 4}, modules_to_save=["lm_head"]
    )
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["use_rslora"] and cfg["alpha_pattern"] == {"down_proj": 4}
    merge_adapter(base, adapter, tmp_path / "out", source="original")
    after, before = _tensors(tmp_path / "out"), load_file(base / "model.safetensors")
    ab = load_file(adapter / "adapter_model.safetensors")
    for module, alpha in (("model.layers.0.mlp.down_proj", 4), ("model.layers.0.self_attn.q_proj", 16)):
        a = ab[f"base_model.model.{module}.lora_A.weight"]
        b = ab[f"base_model.model.{module}.lora_B.weight"]
        expected = before[f"{module}.weight"] + (alpha / math.sqrt(8)) * (b @ a)
        assert torch.equal(after[f"{module}.weight"], expected), module
    assert torch.equal(after["lm_head.weight"], ab["base_model.model.lm_head.weight"])


@pytest.mark.gpu
def test_gpu_merge_matches_cpu_merge(models, tmp_path):
    base, adapter = models["llama"]
    cpu = merge_adapter(base, adapter, tmp_path / "cpu", source="dequantized", device="cpu")
    gpu = merge_adapter(base, adapter, tmp_path / "gpu", source="dequantized", device="cuda")
    assert gpu.devices == {"cuda": 28} and cpu.devices == {"cpu": 28}
    a, b = _tensors(tmp_path / "cpu"), _tensors(tmp_path / "gpu")
    for name in a:
        # Measured on an H200: bitsandbytes' CUDA and CPU NF4 quantizers disagree on ~0.1% of elements
        # (values on a boundary between two codes; largest difference 5e-4 here), so a tensor merged on
        # the CPU after a GPU-trained run can differ from the trained weights by one code step there.
        diff = (a[name] - b[name]).abs()
        assert (diff > 1e-6).float().mean() < 0.02, name  # measured: 0.1% overall, 0.53% in one k_proj
        assert diff.max() < 2e-3, name
    small = merge_adapter(
        base, adapter, tmp_path / "small", source="original", device="cuda", gpu_budget_bytes=1_500_000
    )
    # fp32 working set is 16 bytes/element: attention (<= 1.05 MB) fits, mlp (2.1 MB) goes to the CPU
    assert small.devices == {"cuda": 16, "cpu": 12}
    assert 0 < small.peak_gpu_allocated_bytes <= 1_500_000


def test_budget_fraction_and_foreign_out_dir_are_refused(models, tmp_path):
    from slimtune.merge import MergeError
    from slimtune.merge.budgets import resolve_budgets

    with pytest.raises(ValueError, match=r"merge\.maximum_memory_usage=0\.99: must be in \(0, 0\.95\]"):
        resolve_budgets(0.99, "cpu", None, None)
    assert resolve_budgets(0.5, "cpu", None, 123).host_bytes == 123
    base, adapter = models["llama"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(MergeError, match="exists and is not a slimtune merge output"):
        merge_adapter(base, adapter, foreign, source="original")
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_hub_cache_blob_name_is_trusted_as_its_sha256(tmp_path):
    import hashlib

    from slimtune.merge.manifest import sha256_file

    data = b"weights" * 1000
    name = "ab" * 32  # huggingface_hub names LFS blobs by their verified sha256; the name is not re-read
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / name).write_bytes(data)
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.safetensors").symlink_to(tmp_path / "blobs" / name)
    (tmp_path / "plain.bin").write_bytes(data)
    assert sha256_file(tmp_path / "snapshot" / "model.safetensors") == name
    assert sha256_file(tmp_path / "plain.bin") == hashlib.sha256(data).hexdigest()
