"""Packing: best-fit-decreasing rows, the collator's inputs, and that packed examples stay isolated."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from slimtune.data import (
    IGNORE_INDEX,
    Example,
    RowCollator,
    best_fit_decreasing,
    load_examples,
    one_per_row,
    pack,
    packing_efficiency,
    padded_efficiency,
)
from slimtune.models.families import FAMILIES
from slimtune.models.tiny import DATA_FILE, build_model, ensure_builtin
from slimtune.spec.schema import DataSpec
from slimtune.train import ISOLATING_MODEL_TYPES, choose_batching
from slimtune.train.step.attention import VARLEN, prefer_varlen, register


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_builtin("builtin:tiny-llama"))


@pytest.fixture(scope="module")
def chat_examples(tokenizer):
    return load_examples(DataSpec(path=str(DATA_FILE), max_seq_length=128, eval_fraction=0), tokenizer).train


def _skewed_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    # Log-uniform: most examples short, a long tail up to `high` (typical of chat data).
    rng = random.Random(seed)
    return [int(round(low * (high / low) ** rng.random())) for _ in range(n)]


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    lengths = _skewed_lengths(500, 10, 256, seed=1)
    bins = best_fit_decreasing(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    # Johnson's bound for BFD: at most 11/9 of the optimum (>= the volume bound) plus 4 bins.
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // 256) + 4
    assert bins == best_fit_decreasing(lengths, 256)  # deterministic


def test_best_fit_picks_the_tightest_bin():
    # 6 opens bin A (room 4), 5 opens bin B (room 5); best fit puts 4 into A (exact fit), not B.
    assert best_fit_decreasing([6, 5, 4], 10) == [[0, 2], [1]]


def test_best_fit_rejects_items_longer_than_capacity():
    with pytest.raises(ValueError, match="truncate or drop"):
        best_fit_decreasing([5, 11], 10)


def test_packing_efficiency_at_least_95_percent_against_padded_batches():
    max_len = 512
    lengths = _skewed_lengths(2000, 10, max_len, seed=2)
    examples = [Example([1] * n, [1] * n) for n in lengths]
    packed = packing_efficiency(pack(examples, max_len), max_len)
    naive = padded_efficiency(lengths, batch_size=8)  # same data, classic shuffled padded batches
    assert packed >= 0.95, packed
    assert naive < 0.6 < packed, (naive, packed)


def test_packed_collator_restarts_positions_and_masks_padding():
    a, b, c = Example([5, 6, 7], [-100, 6, 7]), Example([8, 9], [-100, 9]), Example([4], [-100])
    rows = pack([a, b, c], 6)  # a+b+c fit exactly in one row of 6, longest first
    rows += pack([Example([3, 3], [-100, 3])], 6)
    batch = RowCollator("packed", pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4], [3, 3, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 3] + [IGNORE_INDEX] * 4]
    assert "attention_mask" not in batch and batch["use_cache"] is False
    assert batch["_slimtune_token_counts"] == (8, 12)


def test_flash_varlen_batch_is_one_flat_row_with_boundaries():
    rows = pack([Example([1] * 3, [1] * 3), Example([2] * 2, [2] * 2), Example([3] * 4, [3] * 4)], 5)
    batch = RowCollator("packed", pad_token_id=0, flash_varlen=True)(rows)
    assert batch["input_ids"].shape == (1, 9)  # no padding at all
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 7, 9] and batch["max_length_q"] == 4
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]


def test_packed_length_gives_every_batch_one_shape():
    rows = pack([Example([1] * 3, [1] * 3), Example([2] * 2, [2] * 2), Example([3] * 4, [3] * 4)], 5)
    batch = RowCollator("packed", pad_token_id=0, packed_length=6)(rows)
    assert batch["input_ids"].tolist() == [[3, 3, 3, 3, 0, 0], [1, 1, 1, 2, 2, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 0]]
    assert batch["_slimtune_token_counts"] == (9, 12)
    flat = RowCollator("packed", pad_token_id=0, flash_varlen=True, packed_length=6)(rows)
    assert flat["input_ids"].tolist() == [[3, 3, 3, 3, 1, 1, 1, 2, 2, 0, 0, 0]]
    assert flat["labels"][0, 9:].tolist() == [IGNORE_INDEX] * 3
    # boundaries padded with empty segments to 16 entries, the longest bounded by the row: fixed shapes
    assert flat["cu_seq_lens_q"].tolist() == [0, 4, 7, 9, 12] + [12] * 11 and flat["max_length_q"] == 6
    assert flat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1, 2]]


def test_padded_collator_uses_attention_mask():
    rows = one_per_row([Example([1, 2, 3], [-100, 2, 3]), Example([4], [-100])])
    batch = RowCollator("padded", pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100], [-100] * 4]
    assert "position_ids" not in batch


def _loss_sum_and_count(model, batch) -> tuple[float, int]:
    batch = {k: v for k, v in batch.items() if not k.startswith("_")}
    with torch.no_grad():
        loss = model(**batch).loss.double()
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return float(loss) * n, n


@pytest.mark.parametrize(
    "family, attn", [(f, "sdpa" if FAMILIES[f].sdpa else "eager") for f in FAMILIES] + [("llama", "eager")]
)
def test_packed_loss_equals_token_weighted_mean_of_example_losses(family, attn, tokenizer, chat_examples):
    assert family in ISOLATING_MODEL_TYPES
    torch.manual_seed(0)
    # One layer, or enough to reach a global-attention layer where the first are sliding-window ones
    # (gemma2: 2, gemma3_text: 6); granite's logits_scaling (1/16) would shrink every loss difference,
    # leaks included, below the tolerance, so it is 1 here.
    # (Qwen3.5: 4, its first attention layer after three DeltaNet ones, through which one layer's leak is ~1e-7;
    # gpt_oss: 2, its first full-attention layer, where a sliding one's leak at the random init is ~7e-7)
    layers = {"gemma2": 2, "gemma3_text": 6, "qwen3_5_text": 4, "gpt_oss": 2}
    overrides = {"num_hidden_layers": layers[family]} if family in layers else {}
    overrides |= {"logits_scaling": 1.0} if family == "granite" else {}
    overrides = {"num_hidden_layers": 1, **overrides}
    model = build_model(family, len(tokenizer), attn_implementation=attn, **overrides).float()
    examples = chat_examples[:12]
    rows = pack(examples, 128)
    assert any(len(r.seq_lens) > 2 for r in rows)  # really packed
    assert choose_batching(model, "packed").mode == "packed"
    total, count = _loss_sum_and_count(model, RowCollator("packed", tokenizer.pad_token_id)(rows))
    alone = [_loss_sum_and_count(model, RowCollator("padded", 0)(one_per_row([e]))) for e in examples]
    expected = sum(s for s, _ in alone) / sum(n for _, n in alone)
    assert count == sum(n for _, n in alone)
    # fp32 end to end; 1e-5 is ~100x the summation-order noise seen here (1e-7 relative).
    assert total / count == pytest.approx(expected, abs=1e-5)
    # Control: the same rows with one continuous position range attend across examples and differ.
    batch = RowCollator("packed", tokenizer.pad_token_id)(rows)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    leaked, _ = _loss_sum_and_count(model, batch)
    assert abs(leaked / count - expected) > 1e-4  # 10x the tolerance above


def test_unverified_architecture_falls_back_to_padded(caplog):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with caplog.at_level("WARNING"):
        batching = choose_batching(model, "packed")
    assert batching.mode == "padded" and "gpt2" in batching.fallback_reason
    assert "falls back to padded" in caplog.text


@pytest.mark.gpu
def test_flash_varlen_packed_loss_equals_example_losses(tokenizer, chat_examples):
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    model = build_model("llama", len(tokenizer), num_hidden_layers=2, attn_implementation="flash_attention_2")
    model = model.to("cuda", torch.bfloat16)
    batching = choose_batching(model, "packed")
    assert batching.flash_varlen
    rows = pack(chat_examples[:12], 128)
    collate = RowCollator("packed", tokenizer.pad_token_id, flash_varlen=True)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collate(rows).items()}
    total, count = _loss_sum_and_count(model, batch)
    alone = []
    for e in chat_examples[:12]:
        single = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collate(one_per_row([e])).items()}
        alone.append(_loss_sum_and_count(model, single))
    expected = sum(s for s, _ in alone) / sum(n for _, n in alone)
    # bf16 activations: 1e-2 relative covers their rounding (8 mantissa bits, ~4e-3 per op).
    assert total / count == pytest.approx(expected, rel=1e-2)


# gemma3_text: five sliding-window layers of 16 tokens, shorter than the examples, so the window matters
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("flatten", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_varlen_attention_packed_loss_equals_example_losses(family, flatten, tokenizer, chat_examples):
    # Off CUDA the varlen attention runs each example through its own SDPA call: this checks the wiring
    # (boundaries reaching every layer, the flattened row, the head layout), the kernel itself is the GPU test's.
    torch.manual_seed(0)
    model = build_model(family, len(tokenizer), num_hidden_layers=1, attn_implementation="sdpa").float()
    assert prefer_varlen(model, torch.device("cpu")) is False  # no CUDA: stays on sdpa
    register()
    model.set_attn_implementation(VARLEN)
    assert model.config._attn_implementation == VARLEN
    batching = choose_batching(model, "packed")
    assert batching.mode == "packed" and batching.flash_varlen
    examples = chat_examples[:12]
    rows = pack(examples, 128)
    # Fixed-length batches (as on a GPU): the padding is a segment of its own, never a target.
    batch = RowCollator("packed", tokenizer.pad_token_id, flash_varlen=flatten, packed_length=136)(rows)
    assert ("cu_seq_lens_q" in batch) is flatten
    assert batch["input_ids"].numel() == 136 * len(rows)
    total, count = _loss_sum_and_count(model, batch)
    model.set_attn_implementation("sdpa")
    alone = [_loss_sum_and_count(model, RowCollator("padded", 0)(one_per_row([e]))) for e in examples]
    expected = sum(s for s, _ in alone) / sum(n for _, n in alone)
    assert count == sum(n for _, n in alone)
    assert total / count == pytest.approx(expected, abs=1e-5)


@pytest.mark.gpu
def test_torch_varlen_packed_loss_and_grads_match_sdpa(tokenizer, chat_examples):
    torch.manual_seed(0)
    model = build_model("llama", len(tokenizer), num_hidden_layers=2, attn_implementation="sdpa")
    model = model.to("cuda", torch.bfloat16)
    rows = pack(chat_examples[:12], 128)

    def loss_and_grad(flash_varlen: bool) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        batch = RowCollator("packed", tokenizer.pad_token_id, flash_varlen=flash_varlen)(rows)
        batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items() if not k.startswith("_")}
        loss = model(**batch).loss
        loss.backward()
        return float(loss), model.model.layers[0].self_attn.q_proj.weight.grad.float().clone()

    dense_loss, dense_grad = loss_and_grad(False)  # sdpa with transformers' block mask from position ids
    assert prefer_varlen(model, torch.device("cuda")) and model.config._attn_implementation == VARLEN
    varlen_loss, varlen_grad = loss_and_grad(True)
    # bf16 activations: 1e-2 relative covers their rounding (8 mantissa bits, ~4e-3 per op).
    assert varlen_loss == pytest.approx(dense_loss, rel=1e-2)
    assert torch.nn.functional.cosine_similarity(varlen_grad.flatten(), dense_grad.flatten(), dim=0) > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 32], ids=["full", "sliding"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "bucketed"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_varlen_attention_matches_causal_sdpa_per_example_with_gradients(kv_heads, padded, window):
    """aten's flash kernel on flattened examples, k/v with their own head count: outputs and q/k/v gradients
    equal causal SDPA run on each example alone (with its enable_gqa where k/v have fewer heads). Bucketed: the
    boundaries end in empty segments and the longest is only bounded, as the collator makes them for fixed shapes.
    Sliding: each token attends to its last 32 (itself included), against SDPA with transformers' window mask."""
    from slimtune.train.step.attention import varlen_attention_forward

    torch.manual_seed(0)
    lengths, heads, dim = [37, 128, 5, 300], 8, 64
    total = sum(lengths)
    cu = torch.tensor([0, *lengths, *([0] * 11 if padded else [])], dtype=torch.int32)
    cu = cu.cumsum(0, dtype=torch.int32).cuda()

    def make(h: int) -> torch.Tensor:  # (B=1, H, T, D) as transformers hands them over
        return torch.randn(1, h, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    out, _ = varlen_attention_forward(
        torch.nn.Module(),
        q,
        k,
        v,
        None,
        scaling=dim**-0.5,
        cu_seq_lens_q=cu,
        max_length_q=512 if padded else 300,
        sliding_window=window,
    )
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref_out = torch.empty_like(out)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        seg = [t[:, :, a:b].float() for t in (q, k, v)]
        i = torch.arange(b - a, device="cuda")
        mask = (i[:, None] >= i[None, :]) & (i[None, :] > i[:, None] - (window or b))  # masking_utils' overlay
        ref_out[:, a:b] = torch.nn.functional.scaled_dot_product_attention(
            *seg, attn_mask=mask, scale=dim**-0.5, enable_gqa=kv_heads != heads
        ).transpose(1, 2)
    ref = (ref_out, *torch.autograd.grad(ref_out, (q, k, v), dout))
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        # bf16 inputs, fp32 reference: 2e-2 covers bf16 rounding of the kernel's output and gradients
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2, msg=name)
