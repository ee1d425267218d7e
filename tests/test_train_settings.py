"""`resolve_train`: the one place a packed_sft attempt's settings are decided, and who reads it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from model_configs import LLAMA_1B, LLAMA_8B

from slimtune.memory.downshift import DownshiftExhausted
from slimtune.plan.fit import Budget, plan, train_estimate
from slimtune.plan.train_settings import resolve_train
from slimtune.spec.schema import parse_spec

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "deployments" / "data" / "tiny_chat.jsonl"
# The decisions resolve_train makes: a reader calling one of these itself would decide them a second time.
DECISIONS = {
    "auto_micro_batch",
    "downshift_train",
    "train_estimate",
    "rank_checkpointing",
    "excluded_kernels",
    "expected_kernels",
    "run_kernels",
    "varlen_expected",
}


def _spec(tmp_path: Path, lora: dict | None = None, **train):
    model = tmp_path / "llama-8b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_8B))  # no weights: nothing here loads a model
    return parse_spec(
        {
            "name": "settings",
            "output_dir": str(tmp_path / "runs"),
            "model": {"name_or_path": str(model)},
            "lora": {"gradient_checkpointing": "unsloth", **(lora or {})},
            "data": {"path": str(DATA), "max_seq_length": 2048},
            "train": {"micro_batch_size": 4, **train},
            "export": {"gguf": ["f16"]},
        }
    )


def _called(node: ast.AST) -> list[str]:
    """Names of the functions called anywhere under `node` (`f(...)` and `mod.f(...)`)."""
    return [
        c.func.id if isinstance(c.func, ast.Name) else c.func.attr
        for c in ast.walk(node)
        if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))
    ]


def _calls_of(node: ast.AST, name: str) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == name]


def _tree(module: str) -> ast.Module:
    return ast.parse((ROOT / module).read_text(encoding="utf-8"))


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_flow_task_plan_attach_lora_and_the_ranks_decide_nothing_themselves():
    readers = {
        "slimtune/flows/stages.py": _function(_tree("slimtune/flows/stages.py"), "packed_sft_task"),
        "slimtune/plan/fit.py": _function(_tree("slimtune/plan/fit.py"), "plan"),
        "slimtune/tasks/attach_lora.py": _tree("slimtune/tasks/attach_lora.py"),
        "slimtune/flows/ranks.py": _tree("slimtune/flows/ranks.py"),
    }
    for module, node in readers.items():
        called = _called(node)
        assert not DECISIONS & set(called), (module, DECISIONS & set(called))
        if module != "slimtune/flows/ranks.py":  # a rank trains with the flow's settings, passed in the job
            assert called.count("resolve_train") == 1, module
    # each rank's attach_lora resolves with the rank's own plan, and packed_sft gets the job's checkpointing as is
    rank = _function(_tree("slimtune/flows/ranks.py"), "train_rank")
    (attach,) = _calls_of(rank, "attach_lora")
    assert [a.id for a in attach.args if isinstance(a, ast.Name)] == ["spec", "plan"]


def test_the_flow_decides_fitting_only_inside_resolve_train():
    """`gpu_fits` (the guard's preflight now) is what resolve_train's `fits` asks, and nothing else asks it."""
    task = _function(_tree("slimtune/flows/stages.py"), "packed_sft_task")
    (resolve,) = _calls_of(task, "resolve_train")
    fits = next(k.value for k in resolve.keywords if k.arg == "fits")
    assert isinstance(fits, ast.Lambda) and _called(fits) == ["gpu_fits"]
    assert _called(task).count("gpu_fits") == 1


def test_auto_picks_the_largest_divisor_whose_estimate_fits(tmp_path):
    spec = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=12, cuda_graphs=False)
    at = {mb: train_estimate(spec, LLAMA_8B, mb, "unsloth", "cuda").gpu_bytes for mb in (4, 6)}
    six = train_estimate(spec, LLAMA_8B, 6, "unsloth", "cuda").tensors().gpu_bytes
    assert at[4] < six
    limit = (at[4] + six) // 2  # 6 does not run, not even as a tight fit; 4 fits

    settings = resolve_train(spec, LLAMA_8B, "cuda", fits=lambda est: est.gpu_bytes <= limit)
    assert (settings.micro_batch, settings.grad_accum) == (4, 3)
    assert settings.auto_note.startswith("micro_batch_size auto: 4 x 3 accumulation (effective batch 12)")
    assert settings.base_estimate.gpu_bytes == at[4]
    # no budget to hold it to: the first micro-batch of 8192 tokens or more, the rest to stored layers; the whole
    # effective batch in one micro-batch where layers are not stored
    first = resolve_train(spec, LLAMA_8B, "cuda")
    assert (first.micro_batch, first.grad_accum, first.stored_layers) == (4, 3, 32)
    unstored = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=12, stored_layers=0)
    whole = resolve_train(unstored, LLAMA_8B, "cuda")
    assert (whole.micro_batch, whole.grad_accum) == (12, 1)
    # plan's verdict row is the same estimate (plan holds auto to the budget: nothing fits without one)
    budget = Budget(gpu_total=limit, gpu_fraction=None, host=None)
    rows, limits = plan(spec, LLAMA_8B, budget)
    assert limits["micro_batch"] == 4
    assert {r.stage: r.estimate for r in rows}["packed_sft"] == settings.base_estimate
    assert plan(spec, LLAMA_8B, Budget(None, None, None))[1]["micro_batch"] == 1


def test_graphs_are_on_where_their_estimate_fits_and_off_on_a_retry(tmp_path):
    spec = _spec(tmp_path, micro_batch_size=4, gradient_accumulation_steps=1, stored_layers=0)
    first = resolve_train(spec, LLAMA_8B, "cuda")
    assert first.cuda_graphs and first.graphs_off is None and first.downshift_notes == ()
    assert first.estimate.gpu_bytes > first.base_estimate.gpu_bytes  # the graphs' pool is an extra on the GPU

    tight = resolve_train(spec, LLAMA_8B, "cuda", fits=lambda est: est.gpu_bytes <= first.base_estimate.gpu_bytes)
    assert not tight.cuda_graphs and tight.graphs_off == "the estimate with them exceeds the budget"
    assert tight.estimate == tight.base_estimate == first.base_estimate

    retry = resolve_train(spec, LLAMA_8B, "cuda", attempt=2)
    assert (retry.micro_batch, retry.grad_accum, retry.checkpointing) == (2, 2, "unsloth")
    assert not retry.cuda_graphs and retry.graphs_off == "a retry after running out of memory"
    assert len(retry.downshift_notes) == 1 and retry.downshift_notes[0].startswith("attempt 2: ")


def test_auto_weighs_graphs_against_a_larger_micro_batch_and_takes_a_tight_fit_for_either(tmp_path):
    """1B at an effective batch of 4 x 2048 on Unsloth's 2.98 GiB card (H200, 2026-11-28): neither 4 x 1 nor 2 x 2
    with graphs runs there, 1 x 4 with them does, and is predicted faster than 2 x 2 without them (measured: 26,634
    against 22,925 tokens/s). 8B on an 8 GiB card: 2 x 4 without graphs, predicted faster than 1 x 8 with them
    (measured 10,086 and 7,975). Without graphs the largest micro-batch whose tensors fit runs as a tight fit; a fixed
    one gets graphs where only their tensors fit; no layer is stored into the fragmentation allowance."""
    spec = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=4)
    card = int(2.98 * 2**30)

    def fits(est):
        return est.gpu_bytes <= card

    def at(mb: int, graphs: bool, stored: int = 0):
        return train_estimate(spec, LLAMA_1B, mb, "unsloth", "cuda", graphs, stored)

    assert not fits(at(4, False).tensors()) and not fits(at(2, True).tensors()) and fits(at(1, True).tensors())
    assert fits(at(2, False).tensors())
    settings = resolve_train(spec, LLAMA_1B, "cuda", fits=fits)
    assert (settings.micro_batch, settings.grad_accum, settings.cuda_graphs) == (1, 4, True)
    assert settings.auto_note.endswith(
        "with CUDA graphs runs on the budget; predicted 1.14x the tokens/s of micro-batch 2 without them"
    )
    assert fits(settings.estimate)  # the stored layers, chosen on the whole estimate

    plain = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=4, cuda_graphs=False)
    four = at(4, False)
    between = (four.tensors().gpu_bytes + four.gpu_bytes) // 2
    tight = resolve_train(plain, LLAMA_1B, "cuda", fits=lambda est: est.gpu_bytes <= between)
    assert (tight.micro_batch, tight.grad_accum) == (4, 1) and not tight.cuda_graphs
    assert tight.estimate.runs_in(between) and tight.estimate.gpu_bytes > between
    assert tight.stored_layers == 0 and at(4, False, 1).gpu_bytes > between

    eight = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=8)
    held = int(0.95 * 8 * 2**30)  # deployments/llama-3.1-8b.yaml's share of an 8 GiB card
    big = resolve_train(eight, LLAMA_8B, "cuda", fits=lambda est: est.gpu_bytes <= held)
    assert (big.micro_batch, big.grad_accum, big.cuda_graphs) == (2, 4, False)
    assert big.auto_note.endswith("predicted 1.30x the tokens/s of micro-batch 1 with CUDA graphs")
    # the headline's 8B 4 x 2048 cell on Unsloth's 8.70 GiB card (benchmarks/results/user/headline.json's note)
    cell = _spec(tmp_path, micro_batch_size="auto", effective_batch_size=4)
    unsloths = resolve_train(cell, LLAMA_8B, "cuda", fits=lambda est: est.gpu_bytes <= int(8.70 * 2**30))
    assert (unsloths.micro_batch, unsloths.cuda_graphs) == (4, False) and "micro-batch 2 with CUDA graphs" in (
        unsloths.auto_note
    )

    two = _spec(tmp_path, micro_batch_size=2, gradient_accumulation_steps=2)
    graphed = at(2, True)
    between = (graphed.tensors().gpu_bytes + graphed.gpu_bytes) // 2
    graphs = resolve_train(two, LLAMA_1B, "cuda", fits=lambda est: est.gpu_bytes <= between)
    assert graphs.cuda_graphs and graphs.estimate.runs_in(between) and graphs.estimate.gpu_bytes > between


def test_linear_attention_layers_count_their_larger_activations(tmp_path):
    """Qwen3.5's Gated DeltaNet layers keep more than an attention layer (1.5x compiled on an H200, 1.8x eager on
    the CPU, at Qwen3.5-4B's widths): the estimate counts each stored layer at the GPU's factor; auto stores every
    layer without a budget and, under one, what fits at that count; an explicit count is still honoured."""
    from slimtune.memory import activations
    from slimtune.memory import estimate as estimates

    qwen35 = {
        "model_type": "qwen3_5_text",
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "vocab_size": 248320,
        "tie_word_embeddings": True,
    }
    spec = _spec(tmp_path, micro_batch_size=4, gradient_accumulation_steps=1)
    assert resolve_train(spec, qwen35, "cuda").stored_layers == 32  # no budget: every layer fits

    shape = estimates.model_shape(qwen35)
    assert shape.linear_attention
    targets = estimates._targets(shape, "all-linear")
    counted = activations.bytes_per_token_layer(shape, 2, targets, 16)
    est = estimates.estimate_train(
        qwen35, micro_batch=4, seq_len=2048, lora_r=16, target_modules=targets, checkpointing="unsloth", stored_layers=8
    )
    factor = activations.LINEAR_ATTENTION_ACTIVATIONS
    assert factor > 1
    assert est.breakdown["gpu: activations of the stored layers"] == 8 * int(4 * 2048 * int(counted * factor))
    budget = train_estimate(spec, qwen35, 4, "unsloth", "cuda", stored_layers=8).gpu_bytes
    stored = resolve_train(spec, qwen35, "cuda", fits=lambda est: est.gpu_bytes <= budget).stored_layers
    assert 0 < stored <= 8
    fixed = resolve_train(_spec(tmp_path, micro_batch_size=4, stored_layers=3), qwen35, "cuda")
    assert fixed.stored_layers == 3


def test_stored_layers_take_what_the_budget_has_left_after_the_graphs(tmp_path):
    """auto: the largest count of stored layers whose estimate fits, after the micro-batch and the graphs; all of
    them (and no graphs: nothing is recomputed) where they fit; 0 on a retry, the CPU and several GPUs."""
    spec = _spec(tmp_path, micro_batch_size=4, gradient_accumulation_steps=1)
    at = [train_estimate(spec, LLAMA_8B, 4, "unsloth", "cuda", True, n).gpu_bytes for n in range(33)]
    assert all(a < b for a, b in zip(at, at[1:-1], strict=False))  # each stored layer costs memory
    limit = (at[12] + at[13]) // 2
    settings = resolve_train(spec, LLAMA_8B, "cuda", fits=lambda est: est.gpu_bytes <= limit)
    assert settings.cuda_graphs and settings.stored_layers == 12
    assert settings.estimate.gpu_bytes == at[12] <= limit
    assert settings.base_estimate == train_estimate(spec, LLAMA_8B, 4, "unsloth", "cuda")  # what fitting starts from
    assert settings.stored_note == "auto: the last 12 of 32 layers keep their activations, the others are recomputed"

    everything = resolve_train(spec, LLAMA_8B, "cuda")  # no budget to hold it to
    assert everything.stored_layers == 32 and not everything.cuda_graphs
    assert everything.estimate == train_estimate(spec, LLAMA_8B, 4, "unsloth", "cuda", False, 32)

    # no room for the graphs' tensors: the layers get what there is, without them
    room = train_estimate(spec, LLAMA_8B, 4, "unsloth", "cuda", True).tensors().gpu_bytes
    bare = [train_estimate(spec, LLAMA_8B, 4, "unsloth", "cuda", False, n).gpu_bytes for n in range(33)]
    expected = max(n for n in range(33) if bare[n] < room)
    tight = resolve_train(spec, LLAMA_8B, "cuda", fits=lambda est: est.gpu_bytes < room)
    assert not tight.cuda_graphs and tight.stored_layers == expected >= 1

    assert resolve_train(spec, LLAMA_8B, "cuda", attempt=2).stored_layers == 0
    assert resolve_train(spec, LLAMA_8B, "cpu").stored_layers == 0
    fixed = resolve_train(_spec(tmp_path, micro_batch_size=4, stored_layers=5), LLAMA_8B, "cpu")
    assert fixed.stored_layers == 5 and fixed.stored_note is None
    off = resolve_train(_spec(tmp_path, {"gradient_checkpointing": False}, stored_layers=5), LLAMA_8B, "cuda")
    assert off.stored_layers == 0  # without checkpointing every layer keeps its activations already


def test_on_the_cpu_graphs_and_varlen_add_nothing_and_no_kernel_is_expected(tmp_path):
    spec = _spec(tmp_path)
    asked = []
    cpu = resolve_train(spec, LLAMA_8B, "cpu", fits=lambda est: asked.append(est) or True)
    assert cpu.cuda_graphs and cpu.estimate == cpu.base_estimate  # asked for: graphed_backward refuses on the CPU
    assert not cpu.varlen and cpu.kernels == ()
    assert len(asked) == 1  # only the graphs' question: a fixed micro-batch is not searched


def test_fsdp_ranks_run_standard_checkpointing_without_the_kernels_fsdp_breaks(tmp_path):
    spec = _spec(tmp_path, num_gpus=2, parallelism="fsdp")
    settings = resolve_train(spec, LLAMA_8B, "cuda")
    assert settings.checkpointing is True  # "unsloth" is not offered under FSDP
    assert set(settings.kernels_excluded) == {"lora_nf4", "host_embedding", "host_lm_head"}
    assert not set(settings.kernels) & set(settings.kernels_excluded)
    one = resolve_train(_spec(tmp_path), LLAMA_8B, "cuda")
    assert one.checkpointing == "unsloth" and set(one.kernels_excluded) == {"host_lm_head"}  # no card: head on GPU
    assert "lora_nf4" in one.kernels


def test_at_the_last_rung_a_retry_first_gives_up_the_stored_layers_and_graphs(tmp_path):
    """Micro-batch 1 with offloaded checkpointing is the ladder's last rung, but attempt 1 may still have spent memory
    on speed (an estimate too low for the stored layers: gpt-oss-20b under 16 GiB on an H200). The retry gives up
    that alone; only the attempt after it is past the ladder. With nothing to give up, attempt 2 is past it."""
    spec = _spec(tmp_path, micro_batch_size=1, gradient_accumulation_steps=4)
    first = resolve_train(spec, LLAMA_8B, "cuda")
    assert first.stored_layers == 32
    retry = resolve_train(spec, LLAMA_8B, "cuda", attempt=2)
    assert (retry.micro_batch, retry.grad_accum, retry.checkpointing) == (1, 4, "unsloth")
    assert retry.stored_layers == 0 and not retry.cuda_graphs
    assert retry.downshift_notes == ("attempt 2: micro-batch 1 again, every layer recomputed, no CUDA graphs",)
    with pytest.raises(DownshiftExhausted):
        resolve_train(spec, LLAMA_8B, "cuda", attempt=3)

    bare = _spec(tmp_path, micro_batch_size=1, gradient_accumulation_steps=4, stored_layers=0, cuda_graphs=False)
    assert resolve_train(bare, LLAMA_8B, "cuda").stored_layers == 0
    with pytest.raises(DownshiftExhausted):
        resolve_train(bare, LLAMA_8B, "cuda", attempt=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_text", "gemma4_text"])
def test_models_whose_layers_are_never_captured_plan_no_cuda_graphs_and_say_why(tmp_path, family):
    """The runtime leaves their backward eager (`graphs_refusal`: experts picked on the host, document starts read
    aside, key/value states shared between layers), so the plan reserves no pool and names that reason, from the
    config as config.json has it and as the loaded model's config gives it."""
    from slimtune.models.graph_replay import replay_refusal
    from slimtune.models.tiny import build_model

    cfg = build_model(family, 64).config.to_dict()
    settings = resolve_train(_spec(tmp_path, micro_batch_size=1, stored_layers=0), cfg, "cuda", fits=lambda est: True)
    assert not settings.cuda_graphs and settings.graphs_off == replay_refusal(cfg) is not None
    assert settings.estimate == settings.base_estimate  # no graph pool in what the preflight holds to the budget
    assert resolve_train(_spec(tmp_path, micro_batch_size=1, stored_layers=0), LLAMA_8B, "cuda").cuda_graphs


def test_the_lm_head_goes_to_host_memory_only_where_micro_batch_1_does_not_fit_the_card(tmp_path):
    """8B at r=16: micro-batch 1 needs 6.78 GiB with the head on the GPU. On a 6 GiB card the head is streamed from
    host memory (its 0.98 GiB off the estimate, onto the host's), on 8 GiB and without a GPU it stays; and the
    planner's load_4bit reads both tables into host memory then."""
    from slimtune.plan.train_settings import HEAD_ON_GPU, head_on_host, reads_tables_to_host

    spec = _spec(tmp_path, micro_batch_size=1, gradient_accumulation_steps=8, stored_layers=0)
    on_gpu = train_estimate(spec, LLAMA_8B, 1, "unsloth", "cuda")
    head = LLAMA_8B["vocab_size"] * LLAMA_8B["hidden_size"] * 2
    small, large = int(6 * 2**30), int(8 * 2**30)
    assert small < on_gpu.gpu_bytes < large

    streamed = resolve_train(spec, LLAMA_8B, "cuda", card=small)
    assert "host_lm_head" in streamed.kernels and "host_lm_head" not in streamed.kernels_excluded
    assert "6.78 GiB with it on the GPU, more than the 6.00 GiB card" in streamed.head_note
    terms = streamed.base_estimate.breakdown
    assert terms["gpu: embeddings and lm_head"] == 0 and terms["host: lm_head (pinned)"] == head
    assert on_gpu.gpu_bytes - streamed.base_estimate.gpu_bytes > 0.9 * head  # the loss's chunks cost the rest

    for card in (large, None):
        kept = resolve_train(spec, LLAMA_8B, "cuda", card=card)
        assert "host_lm_head" not in kept.kernels and kept.kernels_excluded["host_lm_head"] == HEAD_ON_GPU
        assert kept.head_note is None and kept.base_estimate == on_gpu
    # a trained head, a tied one, and several ranks keep it where peft and DDP want it
    trained = _spec(tmp_path, lora={"train_embeddings": True}, micro_batch_size=1)
    assert not head_on_host(trained, LLAMA_8B, "cuda", small)
    assert not head_on_host(spec, {**LLAMA_8B, "tie_word_embeddings": True}, "cuda", small)
    ddp = _spec(tmp_path, micro_batch_size=1, num_gpus=2)
    assert not head_on_host(ddp, LLAMA_8B, "cuda", small)
    # only where both tables go to the host and the fused loss reads the head there; not under a LoRA on the head
    for kernels in (["fused_linear_ce", "host_lm_head", "lora_nf4"], ["host_embedding", "host_lm_head", "lora_nf4"]):
        assert not head_on_host(_spec(tmp_path, micro_batch_size=1, kernels=kernels), LLAMA_8B, "cuda", small)
    lora_head = _spec(tmp_path, lora={"target_modules": ["q_proj", "lm_head"]}, micro_batch_size=1)
    assert not head_on_host(lora_head, LLAMA_8B, "cuda", small)

    # load_4bit reads the tables into host memory then, unless its model is built otherwise (the loads of an MoE and of
    # a multimodal checkpoint's language model put them on the GPU, and attach_lora moves them)
    assert reads_tables_to_host(True, "llama", False) and not reads_tables_to_host(False, "llama", False)
    assert not reads_tables_to_host(True, "qwen3_moe", False) and not reads_tables_to_host(True, "llama", True)
    # the plan: micro-batch 1 fits the 6 GiB card with the head in host memory, as an H100 held to 6 GiB trained it
    rows, limits = plan(spec, LLAMA_8B, Budget(gpu_total=small, gpu_fraction=None, host=None))
    load = next(r.estimate for r in rows if r.stage == "load_4bit")
    assert load.breakdown["gpu: embeddings and lm_head"] == 0 and limits["extras"].head_note
    # with the head where it will be; micro-batch 2 is a tight fit there (its tensors fit, not its whole estimate)
    assert limits["largest_micro_batch"] == 2 and limits["largest_seq_len"] >= 2048
