"""`slimtune plan` and `micro_batch_size: auto`: verdicts from the calibrated estimates, config.json only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_configs import LLAMA_8B

from slimtune.cli.sizes import parse_size
from slimtune.plan.fit import Budget, plan, render, train_estimate
from slimtune.plan.micro_batch import Graphs, auto_micro_batch, micro_batch_candidates
from slimtune.spec.schema import parse_spec

_GIB = 1024**3
DATA = Path(__file__).resolve().parent.parent / "deployments" / "data" / "tiny_chat.jsonl"


def _spec(tmp_path: Path, **train):
    model = tmp_path / "llama-8b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_8B))  # no weights: the planner reads nothing else
    return parse_spec(
        {
            "name": "plan",
            "output_dir": str(tmp_path / "runs"),
            "model": {"name_or_path": str(model)},
            "lora": {"gradient_checkpointing": "unsloth"},
            "data": {"path": str(DATA), "max_seq_length": 2048},
            "train": {"micro_batch_size": 4, **train},
            "export": {"gguf": ["f16"]},
        }
    )


def test_16_gib_card_fits_the_8b_run_6_gib_micro_batch_1_and_5_25_gib_nothing(tmp_path):
    spec = _spec(tmp_path)
    rows, limits = plan(spec, LLAMA_8B, Budget(16 * _GIB, None, 16 * _GIB))
    verdicts = {r.stage: r.gpu_fits for r in rows}
    assert verdicts["load_4bit"] and verdicts["packed_sft"]
    assert limits["largest_micro_batch"] >= 4  # measured: 4 x 2048 peaks at 9.89 GiB device-wide
    assert limits["largest_seq_len"] >= 2048
    text = render(spec, rows, limits, Budget(16 * _GIB, None, 16 * _GIB))
    assert "packed_sft" in text and "largest micro-batch" in text and "DOES NOT FIT" not in text
    # 6 GiB: the spec's 4 x 2048 does not fit; with the lm_head in host memory micro-batch 1 does (an H100 held to
    # 6 GiB trained it holding 5.34 GiB of the card, 4.52 allocated) and 2 runs as a tight fit; on 5.5 GiB micro-batch
    # 1 is a tight fit, and 5.25 GiB holds not even that (weights, LoRA state and context).
    rows, limits = plan(spec, LLAMA_8B, Budget(6 * _GIB, None, 16 * _GIB))
    assert not {r.stage: r.gpu_fits for r in rows}["packed_sft"]
    assert limits["largest_micro_batch"] == 2 and limits["extras"].head_note
    two = train_estimate(spec, LLAMA_8B, 2, "unsloth", "cuda", head_on_host=True)
    assert two.gpu_bytes > 6 * _GIB >= two.tensors().gpu_bytes
    assert plan(spec, LLAMA_8B, Budget(int(5.5 * _GIB), None, 16 * _GIB))[1]["largest_micro_batch"] == 1
    assert plan(spec, LLAMA_8B, Budget(int(5.25 * _GIB), None, 16 * _GIB))[1]["largest_micro_batch"] is None


def test_budget_fraction_is_a_card_of_that_size(tmp_path):
    """guard.gpu_memory_fraction holds the run device-wide, as the guard does: a share of an 80 GiB card gets the
    verdicts of a whole card that size, the CUDA context counted inside it."""
    total = 80 * _GIB
    spec = _spec(tmp_path, micro_batch_size=1)

    def fits(budget: Budget) -> dict:
        return {r.stage: r.gpu_fits for r in plan(spec, LLAMA_8B, budget)[0]}

    verdicts = {gib: fits(Budget(total, gib * _GIB / total, None)) for gib in (5.5, 6, 7, 8)}
    assert verdicts == {gib: fits(Budget(int(gib * _GIB), None, None)) for gib in verdicts}
    # 8B at 1 x 2048, r=16: 6.78 GiB with the head on the GPU, 5.80 GiB with it streamed from host memory, which the
    # plan does on cards under 6.78 GiB (an H100 held to 6 GiB trained it holding 5.34 GiB of the card)
    assert verdicts[5.5]["packed_sft"] is False and verdicts[6]["packed_sft"] is True


def test_a_card_that_holds_the_tensors_but_not_the_fragmentation_allowance_is_a_tight_fit_that_runs(tmp_path, capsys):
    """8B at 1 x 2048 on 0.95 of a 6 GiB card (5.70 GiB): 5.80 GiB estimated, 0.56 GiB of it the allowance for
    allocator fragmentation, so the guard lets it run (`guard.preflight`) and the plan says so and exits 0; at
    5 GiB its tensors alone do not fit."""
    import yaml

    from slimtune.cli.main import main

    spec = _spec(tmp_path, micro_batch_size=1)
    rows, limits = plan(spec, LLAMA_8B, Budget(6 * _GIB, 0.95, 16 * _GIB))
    sft = next(r for r in rows if r.stage == "packed_sft")
    assert sft.gpu_fits is False and sft.gpu_runs is True
    assert sft.estimate.gpu_bytes - sft.estimate.allowance() <= 0.95 * 6 * _GIB < sft.estimate.gpu_bytes
    text = render(spec, rows, limits, Budget(6 * _GIB, 0.95, 16 * _GIB))
    assert "tight: runs" in text and "DOES NOT FIT" not in text
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    held = ["--set", "guard.gpu_memory_fraction=0.95"]
    assert main(["plan", str(path), "--gpu-memory", "6GiB", "--host-memory", "16GiB", *held]) == 0
    assert "tight: runs" in capsys.readouterr().out
    rows, _ = plan(spec, LLAMA_8B, Budget(5 * _GIB, None, 16 * _GIB))
    assert next(r for r in rows if r.stage == "packed_sft").gpu_runs is False
    assert main(["plan", str(path), "--gpu-memory", "5GiB", "--host-memory", "16GiB"]) == 1


def test_auto_takes_the_largest_divisor_that_fits_and_keeps_the_effective_batch(tmp_path):
    train = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=12).train
    assert micro_batch_candidates(train) == [1, 2, 3, 4, 6, 12]
    assert auto_micro_batch(train, lambda mb: mb <= 5)[:2] == (4, 3)
    assert auto_micro_batch(train, lambda mb: True)[:2] == (12, 1)
    mb, accum, note = auto_micro_batch(train, lambda mb: False)
    assert (mb, accum) == (1, 12) and "none fits" in note
    # rows of 2048 tokens, the spare memory to stored layers: up to the first divisor of 8192 tokens or more
    mb, accum, note = auto_micro_batch(train, lambda mb: True, 2048)
    assert (mb, accum) == (4, 3) and "the first divisor of 8192 tokens or more" in note
    assert auto_micro_batch(train, lambda mb: mb <= 3, 2048)[:2] == (3, 4)
    assert auto_micro_batch(train, lambda mb: True, 512)[:2] == (12, 1)  # 12 x 512 tokens: none reaches 8192
    # a smaller micro-batch with CUDA graphs or a larger one without them: whichever is predicted faster, by how much
    speedup = {(3, 6): 1.2, (2, 6): 0.8, (3, 4): 0.9}

    def graphs(runs_up_to: int) -> Graphs:
        return Graphs(lambda mb: mb <= runs_up_to, lambda graphed, eager: speedup[graphed, eager])

    mb, accum, note = auto_micro_batch(train, lambda mb: mb <= 6, None, graphs(3))
    assert (mb, accum) == (3, 4)
    assert note.endswith(
        "with CUDA graphs runs on the budget; predicted 1.20x the tokens/s of micro-batch 6 without them"
    )
    mb, accum, note = auto_micro_batch(train, lambda mb: mb <= 6, None, graphs(2))
    assert (mb, accum) == (6, 2) and note.endswith("predicted 1.25x the tokens/s of micro-batch 2 with CUDA graphs")
    # graphs on the largest that runs: nothing to weigh
    mb, accum, note = auto_micro_batch(train, lambda mb: mb <= 6, None, graphs(6))
    assert (mb, accum) == (6, 2) and note.endswith("with CUDA graphs runs on the budget")
    assert auto_micro_batch(train, lambda mb: mb <= 6, None, graphs(0))[:2] == (6, 2)
    # stopped at 8192 tokens, the prediction still said
    mb, accum, note = auto_micro_batch(train, lambda mb: True, 2048, graphs(3))
    assert (mb, accum) == (4, 3) and "8192 tokens or more" in note and note.endswith("micro-batch 3 with CUDA graphs")


def test_auto_in_the_plan_reports_the_choice(tmp_path):
    spec = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=16)
    _, limits = plan(spec, LLAMA_8B, Budget(16 * _GIB, None, None))
    assert limits["largest_micro_batch"] >= 8
    # 4 x 2048 tokens keep the GPU busy: the rest of the budget goes to stored layers
    assert limits["micro_batch"] == 4 and limits["extras"].stored_layers > 0
    # without stored layers: the largest micro-batch that runs with CUDA graphs, below the largest that runs at all
    fixed = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=16, stored_layers=0)
    unstored = plan(fixed, LLAMA_8B, Budget(16 * _GIB, None, None))[1]
    graphed = [
        mb
        for mb in (1, 2, 4, 8, 16)
        if Budget(16 * _GIB, None, None).gpu_runs(train_estimate(fixed, LLAMA_8B, mb, "unsloth", "cuda", True))
    ]
    assert unstored["extras"].cuda_graphs and unstored["micro_batch"] == max(graphed) < limits["largest_micro_batch"]


@pytest.mark.parametrize("bad", [0, 5000, "big"])
def test_micro_batch_size_accepts_1_to_4096_or_auto(tmp_path, bad):
    with pytest.raises(ValueError, match="micro_batch_size"):
        _spec(tmp_path, micro_batch_size=bad)


def test_cli_plan_prints_every_stage_and_exits_1_when_something_does_not_fit(tmp_path, capsys):
    import yaml

    from slimtune.cli.main import main

    spec = _spec(tmp_path)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert main(["plan", str(path), "--gpu-memory", "16GiB", "--host-memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    for stage in ("load_4bit", "packed_sft", "dequant_merge", "gguf_convert_and_push"):
        assert stage in out
    assert main(["plan", str(path), "--gpu-memory", "16", "--host-memory", "16"]) == 0  # bare numbers are GiB
    assert capsys.readouterr().out == out
    assert main(["plan", str(path), "--gpu-memory", "6GiB", "--host-memory", "16GiB"]) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * _GIB),
        ("24GB", 24 * 10**9),
        ("512 MiB", 512 * 1024**2),
        ("1.5gib", int(1.5 * _GIB)),
        ("80", 80 * _GIB),
    ],
)
def test_one_size_rule_for_init_and_plan_a_bare_number_is_gib(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "16 GiBs", "-1GiB", "0", ""])
def test_a_bad_size_is_refused_with_examples(bad):
    with pytest.raises(ValueError, match="is not a size; give e.g. 16GiB"):
        parse_size(bad)


def test_cli_plan_of_a_cpu_spec_prints_no_gpu_figures(tmp_path, capsys):
    """A CPU run uses no GPU memory: no GPU rows, budget or limits, even with --gpu-memory or a GPU present."""
    import yaml

    from slimtune.cli.main import main

    spec = _spec(tmp_path)
    spec.model.device = "cpu"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert main(["plan", str(path), "--gpu-memory", "16GiB", "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "GPU" not in out and "micro-batch that fits" not in out, out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    assert rows.count("host") == 4 and set(rows) <= {"host", "disk"}, out
    assert "budget: host 64.00 GiB (model.device is cpu)" in out


def test_the_merge_disk_follows_the_checkpoint_dtype_under_auto(tmp_path):
    """`merge.output_dtype: auto` writes the checkpoint's own dtype: a float32 checkpoint needs twice the disk of a
    bfloat16 one, as the merge itself would write (config.json's `dtype`, or `torch_dtype` of older ones)."""

    def merge_disk(config: dict, output_dtype: str = "auto") -> int:
        spec = _spec(tmp_path)
        spec.merge.output_dtype = output_dtype
        rows, _ = plan(spec, config, Budget(80 * _GIB, None, 64 * _GIB))
        return next(r for r in rows if r.stage == "dequant_merge").estimate.disk_bytes

    bf16 = merge_disk({**LLAMA_8B, "dtype": "bfloat16"})
    assert (
        merge_disk({**LLAMA_8B, "dtype": "float32"}) == merge_disk({**LLAMA_8B, "torch_dtype": "float32"}) == 2 * bf16
    )
    assert merge_disk({**LLAMA_8B, "dtype": "float32"}, "bfloat16") == bf16  # a dtype asked for wins
    assert merge_disk({k: v for k, v in LLAMA_8B.items() if k not in ("dtype", "torch_dtype")}) == bf16


QWEN3_30B_A3B = {  # Qwen3-30B-A3B's config.json (the published sizes)
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def test_an_moe_that_does_not_fit_for_its_adapters_names_the_adapters_first(tmp_path):
    """Qwen3-30B-A3B with LoRA r=16 on every expert on a 24 GiB card: the adapters and their Adam state (12.6 GiB)
    outweigh the step, so the fix named first is the rank, the targets or the 8-bit optimizer, not the micro-batch
    (already 1); r=8 with paged_adamw_8bit fits."""
    model = tmp_path / "qwen3-30b-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))

    def spec(r: int, optimizer: str):
        return parse_spec(
            {
                "name": "moe",
                "output_dir": str(tmp_path / "runs"),
                "model": {"name_or_path": str(model)},
                "lora": {"r": r, "gradient_checkpointing": "unsloth"},
                "data": {"path": str(DATA), "max_seq_length": 2048},
                "train": {"micro_batch_size": 1, "optimizer": optimizer},
                "export": {"gguf": ["f16"]},
            }
        )

    budget = Budget(24 * _GIB, None, 64 * _GIB)
    rows, limits = plan(spec(16, "adamw_torch_fused"), QWEN3_30B_A3B, budget)
    train = {r.stage: r for r in rows}["packed_sft"]
    assert train.gpu_fits is False
    assert train.estimate.fields["gpu"].startswith("lora.r or lora.target_modules")
    assert "paged_adamw_8bit" in train.estimate.fields["gpu"]
    text = render(spec(16, "adamw_torch_fused"), rows, limits, budget)
    assert "to fit: lora.r or lora.target_modules" in text
    rows, _ = plan(spec(8, "paged_adamw_8bit"), QWEN3_30B_A3B, budget)
    assert {r.stage: r.gpu_fits for r in rows}["packed_sft"]
    # a dense model short of memory is still told about its step first
    rows, _ = plan(_spec(tmp_path), LLAMA_8B, Budget(6 * _GIB, None, 16 * _GIB))
    assert {r.stage: r for r in rows}["packed_sft"].estimate.fields["gpu"].startswith("train.micro_batch_size")
