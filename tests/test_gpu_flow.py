"""On a GPU, the real flow recovers from out-of-memory by downshifting, and cleanup returns memory.

A Llama-3.2-1B-shaped model (random weights, built locally) trains without checkpointing at micro-batch
8 under a per-process budget that micro-batch 8 exceeds; the guard turns the OOM into a retry at
micro-batch 4 with twice the accumulation. Run through the device tool: `pytest -m gpu tests/test_gpu_flow.py`.
"""

import json
import os
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def _model_dir(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimtune.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(**_1B, vocab_size=128256, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = root / "llama-1b-shape"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def _data(root: Path) -> Path:
    rng = random.Random(0)
    words = "the model learns from packed rows of text without padding between examples".split()
    path = root / "long.jsonl"
    with path.open("w") as f:
        for _ in range(96):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(1800))}) + "\n")
    return path


def test_flow_recovers_from_oom_and_cleanup_returns_memory(prefect_harness, tmp_path):
    from slimtune.flows.finetune import finetune
    from slimtune.spec.schema import parse_spec

    torch.cuda.init()
    baseline = torch.cuda.memory_allocated()
    spec = parse_spec(
        {
            "name": "gpu-oom",
            "output_dir": str(tmp_path / "runs"),
            "model": {"name_or_path": str(_model_dir(tmp_path)), "device": "cuda"},
            "lora": {"gradient_checkpointing": False},
            "data": {"path": str(_data(tmp_path)), "format": "text", "max_seq_length": 2048, "eval_fraction": 0.0},
            # No checkpointing: activations grow ~1.5 GiB per sequence, so micro-batch 8 (~25 GiB) exceeds a
            # 20 GiB budget while micro-batch 4 fits. Preflight is off so that the real OOM happens.
            "train": {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 2, "save_steps": 100},
            "guard": {
                "gpu_memory_fraction": round(20 * 2**30 / torch.cuda.get_device_properties(0).total_memory, 3),
                "preflight": False,
            },
            "export": {"gguf": []},
        }
    )
    summary = finetune(spec)
    memory = json.loads((spec.run_dir() / "memory" / "packed_sft.json").read_text())
    trained = summary["packed_sft"]
    cleaned = summary["cleanup"]
    out = Path(os.environ.get("OUT", tmp_path))
    (out / "gpu_flow_oom.json").write_text(
        json.dumps(
            {
                "memory": memory,
                "train": {k: trained[k] for k in ("micro_batch_size", "gradient_accumulation_steps", "steps")},
                "cleanup": cleaned,
                "baseline_before_load": baseline,
            },
            indent=2,
            default=str,
        )
    )
    assert memory["attempts"] >= 2 and memory["downshifts"], memory
    assert trained["micro_batch_size"] * trained["gradient_accumulation_steps"] == 8
    assert trained["micro_batch_size"] < 8
    assert not cleaned["survivors"], cleaned["survivors"]  # what still holds the model, if it outlived cleanup
    assert cleaned["after"]["gpu_allocated"] - baseline <= 64 * 2**20, cleaned


def test_flow_trains_through_cuda_graphs_within_its_budget_and_cleanup_frees_their_pool(prefect_harness, tmp_path):
    """The defaults ("unsloth" checkpointing, train.cuda_graphs) under a memory budget: the layers' backward runs
    as graphs, reserved memory stays within the budget, and after cleanup the graphs' pool is gone too."""
    from slimtune.flows.finetune import finetune
    from slimtune.spec.schema import parse_spec

    torch.cuda.init()
    baseline = torch.cuda.memory_allocated()
    budget = 6 * 2**30  # the estimate with graphs at micro-batch 2: ~4 GiB with the CUDA context
    spec = parse_spec(
        {
            "name": "gpu-graphs",
            "output_dir": str(tmp_path / "runs"),
            "model": {"name_or_path": str(_model_dir(tmp_path)), "device": "cuda"},
            "data": {"path": str(_data(tmp_path)), "format": "text", "max_seq_length": 2048, "eval_fraction": 0.0},
            "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4, "save_steps": 100},
            "guard": {"gpu_memory_fraction": round(budget / torch.cuda.get_device_properties(0).total_memory, 3)},
            "export": {"gguf": []},
        }
    )
    assert spec.train.cuda_graphs and spec.lora.gradient_checkpointing == "unsloth"
    torch.cuda.reset_peak_memory_stats()
    summary = finetune(spec)
    trained, cleaned = summary["packed_sft"], summary["cleanup"]
    # the layers `stored_layers: auto` left to recompute (16 less those it stored within the budget) are captured
    # at step 2 and replayed from then on: "8 captured, 24 replays"; the stored ones run as they are
    captured, replays = (int(part.split()[0]) for part in trained["cuda_graphs"].split(", ")[:2])
    assert 0 < captured == 16 - trained["stored_layers"], (trained["cuda_graphs"], trained["stored_layers_auto"])
    assert replays >= 2 * captured, trained["cuda_graphs"]
    assert torch.cuda.max_memory_reserved() <= budget
    assert not cleaned["survivors"], cleaned["survivors"]
    assert cleaned["after"]["gpu_allocated"] - baseline <= 64 * 2**20, cleaned
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - baseline <= 256 * 2**20  # no pool left behind
