"""gpt-oss (gpt_oss) through every stage on the CPU: fused experts read layer by layer (16-bit or MXFP4), NF4 with
LoRA on every expert, packed rows kept apart, the adapter saved per expert of the fused tensors and merged back onto
them, the flow end to end with f16 and q8_0 GGUF checked in llama.cpp.

The experts' NF4 bytes and LoRA math against bitsandbytes and a dense fp32 reference are tests/test_nf4_experts.py's
(its families include gpt_oss); the family table's matrix (merge against the NF4 model, GGUF tensors and logits,
checkpointing, kernels) runs gpt_oss with every other family.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from expert_lora import with_expert_lora
from safetensors.torch import load_file, save_file
from tiny_flows import tiny_flow_spec
from transformers import AutoModelForCausalLM, GptOssForCausalLM

from slimtune.checks.problems import spec_problems
from slimtune.core import registry
from slimtune.data import RowCollator, load_examples, one_per_row, pack
from slimtune.data.formats import IGNORE_INDEX
from slimtune.kernels.nf4_experts import (
    NF4Experts,
    expert_lora_checkpoint,
    load_expert_lora,
    quantize_model_experts,
)
from slimtune.memory.estimate import estimate_load_4bit
from slimtune.merge.errors import AdapterMismatchError
from slimtune.merge.fused_experts import stack_fused_experts
from slimtune.merge.lora_delta import Adapter, LoraFactor
from slimtune.merge.nf4 import TRAINING_NF4
from slimtune.merge.safetensors_io import read_entries
from slimtune.models.family_configs import gpt_oss_check
from slimtune.models.mxfp4 import dequantize_mxfp4
from slimtune.models.tiny import DATA_FILE, build_model, build_tokenizer, save_tiny
from slimtune.spec.schema import DataSpec, ModelSpec, PipelineSpec
from slimtune.tasks.load_4bit import keep_training_layout, load_4bit
from slimtune.tasks.load_experts import load_nf4_experts, without_dense_experts
from slimtune.train.options import choose_batching

_CPU = torch.device("cpu")
_GIB = 1024**3
# gpt-oss-20b's config.json (the Hub's), the sizes the estimates read
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
}


@pytest.fixture(autouse=True)
def _empty_registry():
    yield
    registry.release_all()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The builtin tiny gpt_oss's recipe (4 layers, 8 experts of width 256, top-2), float32, with random expert
    biases (the init's are zeros, which would hide a bias read from the wrong expert)."""
    out = save_tiny(tmp_path_factory.mktemp("gpt_oss") / "model", "gpt_oss")
    [weights] = out.glob("*.safetensors")
    tensors = load_file(weights)
    g = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith("_proj_bias")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=g) * 0.05
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


def _nf4_load_kwargs(dtype: torch.dtype) -> dict:
    return dict(quantization_config=TRAINING_NF4.bnb_config(dtype), dtype=dtype, device_map={"": "cpu"})


def _expert_blocks(model: torch.nn.Module) -> list[NF4Experts]:
    return [m for m in model.modules() if isinstance(m, NF4Experts)]


def _nf4_tensors(block: NF4Experts) -> dict[str, torch.Tensor]:
    """Every stored field of both projections and the biases (not the shared code books)."""
    return {name: t for name, t in block.named_buffers() if not name.endswith(("code", "code2"))}


def _assert_same_experts(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    blocks, expected = _expert_blocks(model), _expert_blocks(reference)
    assert len(blocks) == len(expected) == 4
    for block, reference_block in zip(blocks, expected):
        ours, theirs = _nf4_tensors(block), _nf4_tensors(reference_block)
        assert sorted(ours) == sorted(theirs) and len(ours) == 10  # (gate_up, down) x 4 fields, 2 biases
        for name, tensor in ours.items():
            assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_fused_experts_load_layer_by_layer_as_quantized_after_the_full_load(model_dir, compute_dtype):
    """gpt-oss's checkpoint holds each layer's fused tensors: read one expert matrix at a time, they give the NF4
    bytes (and biases) of quantizing transformers' own full 16-bit load, and the same logits."""
    spec = PipelineSpec()
    spec.model = ModelSpec(name_or_path=str(model_dir), device="cpu", compute_dtype=compute_dtype)
    model = registry.get(load_4bit(spec).handle)
    assert type(model) is GptOssForCausalLM and model.config._attn_implementation == "eager"  # the sinks need it
    dtype = getattr(torch, compute_dtype)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, **_nf4_load_kwargs(dtype))
    keep_training_layout(reference)
    assert quantize_model_experts(reference, dtype) == 4
    _assert_same_experts(model, reference)
    assert _expert_blocks(model)[0].gate_up_bias.abs().max() > 0  # the random biases arrived
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def _random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks [E, out, G, 16] and scales [E, out, G] of an [E, in, out] tensor: every FP4 code, and group
    exponents 2^-10 .. 2^4 around those of trained weights (scale bytes 117-131)."""
    experts, n_in, n_out = shape
    blocks = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(117, 132, (experts, n_out, n_in // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantization_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 64, 96), torch.Generator().manual_seed(0))
    scales[0, 0, 0], scales[0, 1, 1] = 0, 252  # 2^-127 and 2^125: the E8M0 range that stays finite (6 x 2^125)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = torch.stack([dequantize_mxfp4(blocks[e], scales[e], dtype) for e in range(3)])
    assert ours.shape == expected.shape == (3, 64, 96) and ours.dtype == dtype
    assert torch.equal(ours, expected)  # FP4 x 2^k is exact in both dtypes: bit for bit
    assert torch.isfinite(ours).all() and len(ours.unique()) > 60
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(96, 2, 16\) and scales \(96, 3\)"):
        dequantize_mxfp4(blocks[0], scales[0, :, :1].expand(96, 3), dtype)


@pytest.fixture(scope="module")
def mxfp4_dirs(model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny gpt_oss with random MXFP4 experts, saved twice: as the released checkpoints store them (`*_blocks`,
    `*_scales` and an mxfp4 quantization_config) and in 16 bits, transformers' dequantization of those blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(next(model_dir.glob("*.safetensors")))
    g = torch.Generator().manual_seed(1)
    dense, packed = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _random_mxfp4(tuple(tensors[name].shape), g)
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    config = json.loads((model_dir / "config.json").read_text())
    released = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    root = tmp_path_factory.mktemp("mxfp4")
    for folder, weights, quantization in (("dense", dense, None), ("mxfp4", packed, released)):
        (root / folder).mkdir()
        folder_config = {**config, "quantization_config": quantization} if quantization else config
        (root / folder / "config.json").write_text(json.dumps(folder_config))
        save_file(weights, root / folder / "model.safetensors", metadata={"format": "pt"})
        for file in model_dir.glob("tokenizer*"):
            (root / folder / file.name).write_bytes(file.read_bytes())
    return {"dense": root / "dense", "mxfp4": root / "mxfp4"}


def test_mxfp4_checkpoint_loads_the_nf4_of_its_dequantized_weights(mxfp4_dirs, model_dir, tmp_path):
    """load_4bit on a released-style checkpoint (MXFP4 experts, an mxfp4 quantization_config) gives the NF4 experts
    of a 16-bit checkpoint holding transformers' dequantization of those blocks; half a pair is named."""
    loaded = {}
    for folder, path in mxfp4_dirs.items():
        spec = PipelineSpec()
        spec.model = ModelSpec(name_or_path=str(path), device="cpu", compute_dtype="bfloat16")
        loaded[folder] = registry.get(load_4bit(spec).handle)
    _assert_same_experts(loaded["mxfp4"], loaded["dense"])
    entries = {e.name for e in read_entries(mxfp4_dirs["mxfp4"] / "model.safetensors")}
    assert "model.layers.0.mlp.experts.gate_up_proj" not in entries  # really read from the MXFP4 pair

    tensors = load_file(mxfp4_dirs["mxfp4"] / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.down_proj_scales"]  # half a pair is no tensor
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = without_dense_experts(GptOssForCausalLM).from_pretrained(model_dir, **_nf4_load_kwargs(torch.bfloat16))
    message = "model.layers.3.mlp.experts.down_proj is in none of its safetensors shards (1 expert matrices missing)"
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        load_nf4_experts(model, tmp_path, torch.bfloat16, _CPU)


def test_merge_onto_an_mxfp4_checkpoint_equals_the_merge_onto_its_dequantization(mxfp4_dirs, tmp_path):
    """The merge reads MXFP4 experts as load_4bit does: the adapter merged onto the released-style checkpoint (NF4
    round trip of the dequantized experts, then each expert's delta) writes the tensors of the merge onto the
    16-bit one, as a plain 16-bit checkpoint (no blocks, no quantization_config)."""
    from peft import LoraConfig, get_peft_model

    from slimtune.merge import merge_adapter
    from slimtune.train.adapter_io import add_expert_lora

    model = AutoModelForCausalLM.from_pretrained(mxfp4_dirs["dense"], dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
    mlp = ["gate_proj", "up_proj", "down_proj"]
    with_expert_lora(model, "gpt_oss", mlp, r=4, alpha=8, random_b=torch.Generator().manual_seed(3))
    peft_model.save_pretrained(tmp_path / "adapter")
    add_expert_lora(tmp_path / "adapter", peft_model)
    merged = {}
    for folder, path in mxfp4_dirs.items():
        report = merge_adapter(path, tmp_path / "adapter", tmp_path / folder, source="dequantized")
        assert report.tensors_merged == 4 * (2 + 2)  # q_proj, o_proj and the two fused expert tensors per layer
        merged[folder] = {
            k: v for shard in (tmp_path / folder).glob("*.safetensors") for k, v in load_file(shard).items()
        }
    assert merged["mxfp4"].keys() == merged["dense"].keys() and not any("_blocks" in k for k in merged["mxfp4"])
    for name, tensor in merged["dense"].items():
        assert torch.equal(merged["mxfp4"][name], tensor), name
    base = load_file(mxfp4_dirs["dense"] / "model.safetensors")["model.layers.0.mlp.experts.down_proj"]
    assert not torch.equal(merged["mxfp4"]["model.layers.0.mlp.experts.down_proj"], base)  # the adapter moved it
    assert "quantization_config" not in json.loads((tmp_path / "mxfp4" / "config.json").read_text())


def test_expert_lora_is_saved_per_expert_of_the_fused_tensors_and_merged_onto_them():
    """gpt-oss's adapter file: each expert's LoRA under `<block>.<e>.{gate_up,down}_proj` (B's rows in the fused,
    interleaved order), loaded back exactly; the merge stacks a block's experts onto the stored [E, in, out] tensor
    with each expert's delta (B_e A_e)^T."""
    model = build_model("gpt_oss", 64, num_hidden_layers=2)
    quantize_model_experts(model, torch.float32)
    g = torch.Generator().manual_seed(0)
    for block in _expert_blocks(model):
        block.add_lora(rank=4, scale=2.0)
        for name in ("gate_up", "down"):
            b = getattr(block, f"{name}_lora_B")
            b.data = torch.randn(b.shape, generator=g)
    saved = expert_lora_checkpoint(model)
    layer = _expert_blocks(model)[0]
    assert len(saved) == 2 * 8 * 2 * 2  # layers x experts x (gate_up, down) x (A, B)
    key = "model.layers.0.mlp.experts.5.gate_up_proj.lora_{}.weight"
    assert torch.equal(saved[key.format("A")], layer.gate_up_lora_A[5]) and saved[key.format("A")].shape == (4, 256)
    assert torch.equal(saved[key.format("B")], layer.gate_up_lora_B[5]) and saved[key.format("B")].shape == (512, 4)

    fresh = build_model("gpt_oss", 64, num_hidden_layers=2)
    quantize_model_experts(fresh, torch.float32)
    for block in _expert_blocks(fresh):
        block.add_lora(rank=4, scale=2.0)
    assert load_expert_lora(fresh, saved) == 2
    for name in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
        assert torch.equal(getattr(_expert_blocks(fresh)[0], name), getattr(layer, name)), name

    factors = {k.removesuffix(".lora_A.weight") + ".weight": k for k in saved if ".lora_A." in k}
    adapter = Adapter(
        {n: LoraFactor(saved[a], saved[a.replace("lora_A", "lora_B")], 2.0, False) for n, a in factors.items()}
    )
    base = {
        "model.layers.0.mlp.experts.gate_up_proj": _Entry((8, 256, 512)),
        "model.layers.0.mlp.experts.down_proj": _Entry((8, 256, 256)),
    }
    stacked = stack_fused_experts(adapter, base)
    assert set(stacked.lora) == set(base) | {
        n for n in factors if n.startswith("model.layers.1.")
    }  # layer 1: no base here
    gate_up = stacked.lora["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (8, 256, 512)
    expected = 2.0 * (layer.gate_up_lora_B[5] @ layer.gate_up_lora_A[5]).t()
    torch.testing.assert_close(gate_up.delta("cpu")[5], expected.detach(), rtol=0, atol=0)  # same fp32 product
    partial = Adapter({n: f for n, f in adapter.lora.items() if ".experts.3.down_proj" not in n})
    with pytest.raises(
        AdapterMismatchError, match="LoRA on 7 of the 8 experts of model.layers.0.mlp.experts.down_proj"
    ):
        stack_fused_experts(partial, base)


def test_lora_grads_in_bf16_equal_autograd_through_the_dequantized_weights():
    """bf16 experts with fp32 LoRA cast to bf16 for its products (as the dense layers' LoRA): NF4Experts (grouped
    GEMMs whose frozen matmul dequantizes again in backward instead of saving the weight) gives the output and LoRA
    gradients of plain autograd, expert by expert, through transformers' gate on the bf16 weights it dequantizes."""
    model = build_model("gpt_oss", 64, num_hidden_layers=1).to(torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():  # random biases: a bias read from the wrong expert shows
        experts.gate_up_proj_bias.normal_(0, 0.05)
        experts.down_proj_bias.normal_(0, 0.05)
    gate_up_bias, down_bias = experts.gate_up_proj_bias.detach().clone(), experts.down_proj_bias.detach().clone()
    apply_gate = experts._apply_gate
    nf4 = NF4Experts.from_experts(experts, torch.bfloat16)
    nf4.add_lora(rank=4, scale=2.0)
    g = torch.Generator().manual_seed(4)
    for name in ("gate_up", "down"):
        b = getattr(nf4, f"{name}_lora_B")
        b.data = torch.randn(b.shape, generator=g) * 0.05
    tokens, top_k = 40, 2
    x = torch.randn(tokens, 256, generator=g).to(torch.bfloat16)
    index = torch.stack([torch.randperm(7, generator=g)[:top_k] for _ in range(tokens)])  # expert 7 gets none
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(torch.bfloat16)
    dense = {n: getattr(nf4, n).dequantize_experts(0, 8) for n in ("gate_up", "down")}
    reference_lora = {
        n: [getattr(nf4, f"{n}_lora_{ab}").detach().clone().requires_grad_() for ab in "AB"] for n in dense
    }

    def project(h: torch.Tensor, name: str, bias: torch.Tensor, e: int) -> torch.Tensor:
        a, b = reference_lora[name]
        return h @ dense[name][e] + bias[e] + (h @ a[e].to(h.dtype).t()) @ b[e].to(h.dtype).t() * 2.0

    expected = torch.zeros_like(x)
    for e in range(8):
        position, token = torch.where(index.t() == e)  # transformers' order: by top-k slot, then token
        hidden = project(apply_gate(project(x[token], "gate_up", gate_up_bias, e)), "down", down_bias, e)
        expected.index_add_(0, token, hidden * weights[token, position, None])
    got = nf4(x, index, weights)
    grad = torch.randn(got.shape, generator=g).to(torch.bfloat16)
    got.backward(grad)
    expected.backward(grad)
    assert torch.equal(got, expected)  # the same bf16 ops in the same order
    for name, (a, b) in reference_lora.items():
        # fp32 LoRA gradients of the same bf16 activations, tokens in the same order: bitwise equal
        assert torch.equal(getattr(nf4, f"{name}_lora_A").grad, a.grad), name
        assert torch.equal(getattr(nf4, f"{name}_lora_B").grad, b.grad), name
        assert a.grad[7].abs().max() == 0 and b.grad[:7].abs().max() > 0  # no token, no gradient


class _Entry:
    """The shape of a base tensor, all `stack_fused_experts` reads of it."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def _loss_sum_and_count(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    batch = {k: v for k, v in batch.items() if not k.startswith("_")}
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return model(**batch).loss.double() * n, n


def test_packed_loss_and_lora_grads_equal_the_examples_alone():
    """NF4 experts with LoRA, one sliding and one full-attention layer with sinks: packed rows give the token-weighted
    mean of the examples' own losses and the same LoRA gradients. transformers' gpt-oss builds its masks without the
    position ids, so without `mask_documents` (wired by choose_batching) the rows attend across examples."""
    tokenizer = build_tokenizer()
    examples = load_examples(DataSpec(path=str(DATA_FILE), max_seq_length=128, eval_fraction=0), tokenizer).train[:12]
    torch.manual_seed(0)
    model = build_model("gpt_oss", len(tokenizer), num_hidden_layers=2, attn_implementation="eager")
    quantize_model_experts(model, torch.float32)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    for block in _expert_blocks(model):
        block.add_lora(rank=4, scale=2.0)
        for b in (block.gate_up_lora_B, block.down_lora_B):  # non-zero: every factor gets a gradient
            b.data = torch.randn(b.shape, generator=g) * 0.05
    rows = pack(examples, 128)
    assert any(len(r.seq_lens) > 2 for r in rows)
    packed_batch = RowCollator("packed", tokenizer.pad_token_id)(rows)
    with torch.no_grad():
        leaked, count = _loss_sum_and_count(model, packed_batch)  # before choose_batching: transformers' own masks
    assert choose_batching(model, "packed").mode == "packed"
    lora = [p for p in model.parameters() if p.requires_grad]
    total, count = _loss_sum_and_count(model, packed_batch)
    packed_grads = torch.autograd.grad(total / count, lora)
    sums, counts = zip(*[_loss_sum_and_count(model, RowCollator("padded", 0)(one_per_row([e]))) for e in examples])
    expected = sum(sums) / sum(counts)
    alone_grads = torch.autograd.grad(expected, lora)
    assert count == sum(counts)
    # fp32 end to end: 1e-5 is ~100x the summation-order noise (measured 9e-8); transformers' own masks leak 1.1e-2
    assert float(total.detach() / count) == pytest.approx(float(expected.detach()), abs=1e-5)
    assert abs(float(leaked / count - expected.detach())) > 1e-3
    for ours, theirs in zip(packed_grads, alone_grads):  # measured max 1.7e-8 on gradients up to 2-6e-2
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)
    assert all(grad.abs().max() > 0 for grad in packed_grads)


def _saved_bytes(model: torch.nn.Module, seq: int) -> int:
    """Bytes autograd keeps for backward through one layer's attention on one row of `seq` tokens (each storage
    once)."""
    attention = model.model.layers[1].self_attn  # full attention: no window
    hidden = torch.randn(1, seq, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(seq).unsqueeze(0)
    saved: dict[int, int] = {}

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        attention(hidden, position_embeddings=model.model.rotary_emb(hidden, position_ids), attention_mask=None)
    return sum(saved.values())


def test_eager_attention_keeps_one_16_bit_score_per_head_pair_as_the_estimate_counts():
    """gpt-oss's sinks keep transformers' eager attention, which saves each head's softmaxed scores for backward:
    quadratic in the row's length. The estimate counts one 16-bit score per head and query-key pair per stored layer
    (`ModelShape.eager_attention`); saved-tensor hooks on a tiny bf16 layer at three lengths measure that quadratic
    term. Without it an H200 run of gpt-oss-20b under 16 GiB ran out of memory on a 512 MiB score tensor."""
    from slimtune.memory.estimate import estimate_train

    torch.manual_seed(0)
    model = build_model("gpt_oss", 64, num_hidden_layers=2, attn_implementation="eager").to(torch.bfloat16)
    step = 128  # a + b S + c S^2 at S, 2S and 3S: the second difference is 2 c S^2 (weights and linear terms drop)
    measured = [_saved_bytes(model, k * step) for k in (1, 2, 3)]
    quadratic = (measured[2] - 2 * measured[1] + measured[0]) / (2 * step**2)
    heads = model.config.num_attention_heads
    assert quadratic == heads * 2  # one bf16 score per head and query-key pair (the sink's column is linear)

    cfg = model.config.to_dict()
    stored = [
        estimate_train(
            cfg, micro_batch=1, seq_len=k * step, lora_r=8, target_modules=["q_proj"], checkpointing=False
        ).breakdown["gpu: activations (no checkpointing)"]
        for k in (1, 2, 3)
    ]
    assert (stored[2] - 2 * stored[1] + stored[0]) / (2 * step**2) == heads * 2 * cfg["num_hidden_layers"]


def test_validate_accepts_gpt_oss_and_the_check_refuses_what_llama_cpp_cannot_run(tmp_path):
    spec = PipelineSpec.model_validate(
        {
            "output_dir": str(tmp_path),
            "model": {"name_or_path": "builtin:tiny-gpt_oss", "device": "cpu"},
            "data": {"path": str(DATA_FILE)},
        }
    )
    assert spec_problems(spec) == []
    spec.model.attn_implementation = "flash_attention_2"
    [sinks] = spec_problems(spec)
    assert sinks.startswith("model.attn_implementation: flash_attention_2 cannot run gpt_oss's learned attention sinks")
    assert gpt_oss_check(GPT_OSS_20B) is None
    assert "swiglu_limit 8.0" in gpt_oss_check({**GPT_OSS_20B, "swiglu_limit": 8.0})
    assert "attention_bias is false" in gpt_oss_check({**GPT_OSS_20B, "attention_bias": False})
    assert "no sliding_window" in gpt_oss_check({**GPT_OSS_20B, "sliding_window": None})


def test_estimates_take_the_expert_width_from_intermediate_size():
    """gpt-oss's experts are intermediate_size wide (no moe_intermediate_size): 32 x 3 x 2880 x 2880 weights a layer."""
    h, layers = 2880, 24
    attention = h * 64 * 64 * 2 + h * 8 * 64 * 2  # q, o and k, v
    experts = 32 * 3 * h * 2880
    nf4 = estimate_load_4bit(GPT_OSS_20B, compute_dtype_bytes=2).breakdown["gpu: nf4 linears"]
    per_weight = 0.5 + 1 / 64 + 4 / (64 * 256)  # NF4 with double quantization
    assert nf4 == pytest.approx(layers * (attention + experts) * per_weight, rel=2e-3)
    assert 9.4 < nf4 / _GIB < 9.6  # 19.7e9 weights in the layers


def test_released_yarn_rope_converts_and_llama_cpp_follows_it(tmp_path):
    """gpt-oss's released rope (yarn, factor 32 from 4096, `truncate: false`, which no GGUF key carries): the f32 GGUF's
    logits in llama.cpp against transformers' on the tiny gpt_oss (random init)."""
    pytest.importorskip("llama_cpp")
    from gguf_checks import PROMPTS

    from slimtune.export import convert_hf_to_gguf, verify_gguf

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0}
    rope |= {"truncate": False, "original_max_position_embeddings": 4096}  # transformers' GptOssConfig default
    model = save_tiny(tmp_path / "m", "gpt_oss", rope_parameters=rope, max_position_embeddings=131072)
    [path] = convert_hf_to_gguf(model, tmp_path / "m.gguf", "f32")
    report = verify_gguf(path, model, PROMPTS)
    # llama.cpp rounds the yarn ramp's ends (transformers' truncate: true): measured 2.9e-4 (9e-7 with truncate true)
    assert report["token_ids_equal"] and report["argmax_agreement"] == 1.0, report
    assert report["max_abs_logit_diff"] < 1e-3, report


def test_flow_trains_the_experts_merges_and_exports(prefect_harness, tmp_path):
    """The six tasks on the builtin tiny gpt_oss: LoRA on attention and every expert, packed training, the merge of
    the fused expert tensors, f16 and q8_0 GGUF verified in llama.cpp (the flow's check)."""
    pytest.importorskip("llama_cpp")
    from slimtune.flows.finetune import finetune

    spec = tiny_flow_spec("gpt_oss", tmp_path)
    assert finetune(spec, return_state=True).is_completed()
    report = json.loads((spec.run_dir() / "report.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(report["attach_lora"]["target_modules"])
    train = report["packed_sft"]
    assert train["batching"] == "packed" and train["eval_loss_after"] < train["eval_loss_before"]
    adapter = load_file(spec.run_dir() / "adapter" / "adapter_model.safetensors")
    assert sum(".mlp.experts." in k for k in adapter) == 4 * 8 * 2 * 2  # layers x experts x (gate_up, down) x (A, B)
    assert report["dequant_merge"]["tensors_merged"] == 4 * (4 + 2)  # attention and the two fused expert tensors
    verification = report["gguf_convert_and_push"]["verification"]
    f16, q8 = verification[f"{spec.name}-f16.gguf"], verification[f"{spec.name}-q8_0.gguf"]
    assert f16["token_ids_equal"] and f16["argmax_agreement"] >= 0.95, f16
    assert q8["token_ids_equal"] and q8["argmax_agreement"] >= 0.8, q8
