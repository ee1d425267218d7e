"""FSDP-QLoRA wiring (`train.parallelism: fsdp`), on the CPU: what can be checked without GPUs.

accelerate enables FSDP only for GPU backends (on a CPU process group it would silently train DDP), so
the training itself runs only on GPUs (benchmarks/ddp_bench.py, through the device tool). Checked here:
the 4-bit storage dtype FSDP needs and that it leaves the NF4 bytes (so the merge) unchanged, the
Trainer's FSDP settings, the guard's per-rank estimate, and the clear refusals.
"""

from __future__ import annotations

import pytest
import torch
from prefect_server import REPO

from slimtune.core import registry
from slimtune.models.families import FAMILIES
from slimtune.spec.schema import SpecError, load_spec, parse_spec

# Qwen2.5-14B's shape: its NF4 weights (~9.7 GB with bf16 embeddings) plus a 4 x 2048 step do not fit 12 GiB.
QWEN_14B = {
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
_GIB = 1024**3


def _spec(tmp_path, parallelism: str):
    spec = load_spec(REPO / "deployments" / "tiny-smoke.yaml")
    spec.output_dir, spec.name = str(tmp_path), parallelism
    spec.train.num_gpus, spec.train.parallelism = 2, parallelism
    return spec


def test_fsdp_stores_nf4_in_the_compute_dtype_with_the_same_bytes(tmp_path):
    """FSDP shards only float tensors: the packed NF4 bytes are viewed as the compute dtype, bytes unchanged."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    from slimtune.tasks.load_4bit import load_4bit

    weights = {}
    for parallelism in ("ddp", "fsdp"):
        try:
            model = registry.get(load_4bit(_spec(tmp_path, parallelism)).handle)
            layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
            packed = layer.weight.data
            weights[parallelism] = (
                packed.dtype,
                packed.view(torch.uint8).flatten().clone(),  # the packed bytes, whatever dtype views them
                dequantize_4bit(packed, layer.weight.quant_state),
            )
        finally:
            registry.release_all()
    assert weights["ddp"][0] == torch.uint8 and weights["fsdp"][0] == torch.float32  # the CPU's compute dtype
    assert torch.equal(weights["ddp"][1], weights["fsdp"][1])  # same bytes: the merge reproduces either
    assert torch.equal(weights["ddp"][2], weights["fsdp"][2])


def test_trainer_arguments_set_up_fsdp1_with_flat_parameters_and_no_checkpoints(tmp_path):
    from slimtune.spec.schema import TrainSpec
    from slimtune.train.arguments import training_arguments

    args = training_arguments(
        TrainSpec(num_gpus=2, parallelism="fsdp"),
        tmp_path,
        micro_batch_size=2,
        accumulation=1,
        precision="fp32",
        optim="adamw_torch",
        device=torch.device("cpu"),
        has_eval=False,
        bucket_cap_mb=25,
        fsdp=True,
    )
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 1 and plugin["use_orig_params"] is False, plugin
    assert plugin["state_dict_type"] == "FULL_STATE_DICT" and plugin["sync_module_states"] is False
    assert args.save_strategy == "no"
    ddp = training_arguments(
        TrainSpec(num_gpus=2),
        tmp_path,
        micro_batch_size=2,
        accumulation=1,
        precision="fp32",
        optim="adamw_torch",
        device=torch.device("cpu"),
        has_eval=False,
        bucket_cap_mb=3,
    )
    assert ddp.fsdp_plugin_args is None and ddp.ddp_static_graph and ddp.ddp_bucket_cap_mb == 3


def test_the_guard_estimates_fsdp_per_rank(tmp_path):
    """14B, 1 x 2048 per GPU, standard checkpointing (what FSDP runs), a 12 GiB allocator budget: one GPU
    does not fit, each of 2 FSDP ranks does (benchmarks/ddp_bench.py --parallelism fsdp checks it on GPUs).

    Through the stage's own estimate, both with the kernels an FSDP rank keeps (it leaves lora_nf4 and
    host_embedding out; with them, and "unsloth" checkpointing, one GPU fits this step in 9.97 GiB).
    """
    from slimtune.plan.fit import train_estimate
    from slimtune.plan.train_settings import FSDP_EXCLUDED_KERNELS

    def estimate(num_gpus: int, parallelism: str, checkpointing: bool | str = True):
        spec = _spec(tmp_path, parallelism)
        spec.train.num_gpus, spec.data.max_seq_length = num_gpus, 2048
        spec.lora.r, spec.lora.target_modules = 16, "all-linear"
        spec.train.kernels = [k for k in FAMILIES["qwen2"].kernels if k not in FSDP_EXCLUDED_KERNELS]
        return train_estimate(spec, QWEN_14B, 1, checkpointing, device_type="cuda")

    def allocator(est) -> float:  # the budget caps the allocator; the CUDA context is outside it
        return est.gpu_bytes - est.context_gpu_bytes

    one, ddp, two = estimate(1, "ddp"), estimate(2, "ddp"), estimate(2, "fsdp")
    assert allocator(one) > 12 * _GIB > allocator(two), (allocator(one) / _GIB, allocator(two) / _GIB)
    assert ddp.gpu_bytes == one.gpu_bytes  # with host_embedding left out of both, a DDP rank is one GPU
    assert estimate(2, "fsdp", "unsloth").breakdown == two.breakdown  # a rank runs "unsloth" as standard
    # FSDP1 keeps the root unit (input table and lm_head) gathered for the whole step, beside its shard
    tables = "gpu: embeddings and lm_head"
    assert two.breakdown["gpu: gathered root unit (FSDP: embeddings and lm_head)"] == ddp.breakdown[tables]
    nf4, lora = "gpu: nf4 linears", "gpu: lora weights and grads (fp32)"
    # the packed data is sharded; each linear's quantization state (1 byte per 64 weights) stays whole
    assert 0.025 < (two.breakdown[nf4] * 2 - one.breakdown[nf4]) / one.breakdown[nf4] < 0.035
    assert two.breakdown[lora] * 2 - one.breakdown[lora] in (0, 1)
    assert 0 < two.breakdown["gpu: gathered layers (FSDP: computing and prefetched)"] < one.breakdown[nf4] / 20
    # A rank loads into host memory and FSDP places it unit by unit: never the whole NF4 model on its GPU.
    whole = sum(ddp.breakdown[k] for k in ("gpu: nf4 linears", "gpu: embeddings and lm_head"))
    assert two.gpu_bytes < whole + two.context_gpu_bytes + sum(
        v for k, v in two.breakdown.items() if k.startswith("gpu: gathered")
    )


def test_fsdp_rank_beats_the_best_single_gpu_where_the_tables_are_small(tmp_path):
    """The bench's Done-when shape (benchmarks/ddp_bench.py --shape qwen14b-v32k --budget-gib 8.4): one GPU with
    slimtune's best settings does not fit 8.4 GiB, an FSDP rank does, each by at least 0.4 GiB. With Qwen's 152k
    vocabulary the tables FSDP1 keeps gathered outweigh the sharded layers: the rank does not win there."""
    from benchmarks.common import MODEL_SHAPES
    from slimtune.plan.fit import train_estimate
    from slimtune.plan.train_settings import FSDP_EXCLUDED_KERNELS

    def allocator(cfg: dict, num_gpus: int, checkpointing: bool | str, kernels: list[str]) -> float:
        spec = _spec(tmp_path, "fsdp")
        spec.train.num_gpus, spec.data.max_seq_length, spec.train.kernels = num_gpus, 2048, kernels
        spec.lora.r, spec.lora.target_modules = 16, "all-linear"
        est = train_estimate(spec, cfg, 1, checkpointing, device_type="cuda")
        return (est.gpu_bytes - est.context_gpu_bytes) / _GIB

    every = list(FAMILIES["qwen2"].kernels)
    rank_kernels = [k for k in every if k not in FSDP_EXCLUDED_KERNELS]
    shape = MODEL_SHAPES["qwen14b-v32k"]
    cfg = {"model_type": shape.family, **shape.config}
    best, rank = allocator(cfg, 1, "unsloth", every), allocator(cfg, 2, True, rank_kernels)
    assert best - 0.4 > 8.4 > rank + 0.4, (best, rank)
    assert allocator(QWEN_14B, 2, True, rank_kernels) > allocator(QWEN_14B, 1, "unsloth", every)


@pytest.mark.parametrize("layers,seq", [(2, 128), (48, 2048)])
def test_fsdp_step_estimate_covers_wrapping_the_root_unit(layers, seq):
    """FSDP wraps the root unit last, every layer already sharded: its tables and their flat copy (2 x the
    tables) beside the shards and the LoRA weights. The step's estimate (gathered root, its shard, their
    fragmentation) stays above that, also where the tables dominate (2 layers, 152k vocabulary, 128 tokens)."""
    from slimtune.memory.estimate import estimate_train

    cfg = dict(QWEN_14B, num_hidden_layers=layers)
    est = estimate_train(
        cfg, micro_batch=1, seq_len=seq, lora_r=16, target_modules="all-linear", checkpointing=True, shard_ranks=2
    )
    tables = cfg["vocab_size"] * cfg["hidden_size"] * 2 * 2  # input table and lm_head, bf16
    shards = sum(
        est.breakdown[f"gpu: {k}"] for k in ("nf4 linears", "norms and biases", "lora weights and grads (fp32)")
    )
    assert est.gpu_bytes > 2 * tables + shards + est.context_gpu_bytes


def test_an_fsdp_rank_on_a_gpu_loads_into_host_memory(tmp_path):
    from slimtune.tasks.load_4bit import loads_on_host

    fsdp, ddp = _spec(tmp_path, "fsdp"), _spec(tmp_path, "ddp")
    assert loads_on_host(fsdp, torch.device("cuda", 1))
    assert not loads_on_host(ddp, torch.device("cuda", 1)) and not loads_on_host(fsdp, torch.device("cpu"))
    fsdp.train.num_gpus = 1
    assert not loads_on_host(fsdp, torch.device("cuda", 0))


def test_fsdp_placement_leaves_only_the_packed_nf4_data_on_the_host(tmp_path, monkeypatch):
    """What FSDP moves as it wraps (each Params4bit) stays put; every other parameter, buffer and quantization
    state is sent to the rank's device, and the model says where. No GPU here: the moves are recorded."""
    import bitsandbytes as bnb

    from slimtune.tasks.load_4bit import _place_for_fsdp, load_4bit

    try:
        model = registry.get(load_4bit(_spec(tmp_path, "fsdp")).handle)
        tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
        moved: list[int] = []
        real_to = torch.Tensor.to

        def record_to(self, *args, **kwargs):
            if args and args[0] == torch.device("cuda", 1):
                moved.append(self.data_ptr())
                return real_to(self, "cpu")
            return real_to(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", record_to)
        _place_for_fsdp(model, torch.device("cuda", 1))
        monkeypatch.undo()
        packed = [p for p in model.parameters() if isinstance(p, bnb.nn.Params4bit)]
        rest = [p for p in model.parameters() if not isinstance(p, bnb.nn.Params4bit)]
        assert packed and rest and not {p.data_ptr() for p in packed} & set(moved)
        assert {p.data_ptr() for p in rest} <= set(moved)
        states = [m.quant_state for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert {s.absmax.data_ptr() for s in states} <= set(moved)  # nested absmax: quantized before the move
        assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
        assert model.hf_device_map == {"": "cuda:1"}
    finally:
        registry.release_all()


def test_fsdp_refusals_name_the_fix(tmp_path):
    from slimtune.flows import ranks

    with pytest.raises(ValueError, match="use train.parallelism: ddp"):
        ranks.check_devices(_spec(tmp_path, "fsdp"))  # the spec's device is cpu
    with pytest.raises(SpecError, match="train.*paged_adamw_8bit.*use adamw_torch"):
        parse_spec({"train": {"num_gpus": 2, "parallelism": "fsdp", "optimizer": "paged_adamw_8bit"}})


def test_fsdp_ranks_leave_out_what_fsdp1_cannot_train_through():
    """Kernels that read weights outside their FSDP unit, and "unsloth" checkpointing (stale parameters)."""
    from slimtune.plan.train_settings import excluded_kernels, rank_checkpointing
    from slimtune.spec.schema import TrainSpec

    fsdp, ddp, one = TrainSpec(num_gpus=2, parallelism="fsdp"), TrainSpec(num_gpus=2), TrainSpec()
    assert set(excluded_kernels(fsdp)) == {"lora_nf4", "host_embedding", "host_lm_head"}
    assert set(excluded_kernels(ddp)) == {"host_embedding", "host_lm_head"} == set(excluded_kernels(ddp, True))
    assert set(excluded_kernels(one)) == {"host_lm_head"} and excluded_kernels(one, head_on_host=True) == {}
    assert rank_checkpointing(fsdp, "unsloth") is True and rank_checkpointing(fsdp, False) is False
    assert rank_checkpointing(ddp, "unsloth") == "unsloth" == rank_checkpointing(one, "unsloth")


def test_fsdp_load_keeps_each_quant_state_on_its_module(tmp_path):
    """bitsandbytes restores a flattened weight's quant_state from its module under FSDP: it must be there,
    also where the loader did not put it (the helper fills it in)."""
    import bitsandbytes as bnb

    from slimtune.tasks.load_4bit import _keep_quant_state_on_module, load_4bit

    try:
        model = registry.get(load_4bit(_spec(tmp_path, "fsdp")).handle)
        linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert linears and all(m.quant_state is m.weight.quant_state for m in linears)
        for m in linears:
            m.quant_state = None
        _keep_quant_state_on_module(model)
        assert all(m.quant_state is m.weight.quant_state for m in linears)
    finally:
        registry.release_all()


def test_ddp_bench_fsdp_mode_on_the_cpu_checks_the_estimates_and_runs_the_single_reference(tmp_path, monkeypatch):
    """The GPU command's plumbing: plan verdicts for one GPU and one rank under the budget, then the single run."""
    import json

    from benchmarks import ddp_bench
    from slimtune.models.tiny import ensure_builtin

    monkeypatch.setenv("DDP_BENCH_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--parallelism", "fsdp", "--budget-gib", "12", "--micro", "1", "--seq", "64"]
    model = str(ensure_builtin("builtin:tiny-qwen2"))
    assert ddp_bench.main([*argv, "--steps", "2", "--model", model, "--out", str(out)]) == 0
    fit = json.loads((out / "ddp_bench-fsdp.fit.json").read_text())
    assert fit["budget_gib"] == 12 and fit["single"]["fits"] and fit["per_rank"]["fits"]  # a tiny model fits
    assert fit["single_best"]["fits"] and fit["single_best_attempt"] == {"refused": False, "error": None}
    assert fit["per_rank"]["breakdown_gib"]["gpu: gathered root unit (FSDP: embeddings and lm_head)"] > 0
    # The harness's spec runs on the CPU, so its rendered plan has no GPU rows (a CPU run holds no GPU memory);
    # the GPU verdicts under the budget are the fields above.
    assert fit["single"]["plan"].splitlines()[1].startswith("budget: host")
    single = json.loads((out / "ddp_bench-fsdp.single.json").read_text())
    assert [e["step"] for e in single["losses"]] == [1, 2] and single["gradient_accumulation_steps"] == 2
    assert single["memory"]["peak_gpu_allocated"] is None  # no GPU: the guard recorded host memory only


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rope_stays_float32_where_fsdp_casts_buffers(family):
    """FSDP1 casts registered buffers to bf16 at the first forward; RoPE's inv_freq must not follow."""
    from slimtune.models.tiny import build_model
    from slimtune.train.step.fp32_rope import keep_rope_fp32

    model = build_model(family, vocab_size=256).eval()
    ids = torch.arange(200).remainder(256)[None]  # positions up to 199: a bf16 inv_freq moves their angles
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert keep_rope_fp32(model) >= 1
        assert not any(n.endswith("inv_freq") for n, _ in model.named_buffers())
        for b in model.buffers():  # what FSDP's MixedPrecision(buffer_dtype=bf16) does
            b.data = b.data.to(torch.bfloat16)
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    rotary = next(m for m in model.modules() if hasattr(m, "inv_freq"))
    assert rotary.inv_freq.dtype == torch.float32
