"""SmolLM3's NoPE layers: the rope kernel leaves them alone, and configs llama.cpp cannot run are refused.

The family's other stages (NF4 load, LoRA, packing, eval-then-train, merge, GGUF in llama.cpp) run in the
tests parametrized over the family table; the tiny smollm3 has 4 layers, so its layer 3 is a NoPE layer there.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from slimtune.cli.main import EXIT_INVALID_SPEC, main
from slimtune.kernels import apply_kernels
from slimtune.models.families import check_architecture
from slimtune.models.tiny import build_model, save_tiny


def _config(**overrides) -> dict:
    return build_model("smollm3", 64, **overrides).config.to_dict()


def test_the_tiny_model_has_a_nope_layer_that_changes_its_output():
    model = build_model("smollm3", 64)
    assert [bool(layer.self_attn.use_rope) for layer in model.model.layers] == [True, True, True, False]
    all_rope = build_model("smollm3", 64, no_rope_layers=[1, 1, 1, 1])  # same seed, same weights
    ids = torch.arange(1, 13).view(1, -1)
    with torch.no_grad():
        nope, rope = model(ids).logits, all_rope(ids).logits
    # a converter or kernel that rotated layer 3 would be off by this much (measured 5.8e-3), far above fp32 noise
    assert (nope - rope).abs().max() > 1e-4


def test_rope_kernel_skips_nope_layers_and_matches_eager():
    model = build_model("smollm3", 128).train()
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]), labels=ids)
    ref = model(**batch).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    patch = apply_kernels(model, ["rope"])
    try:
        assert patch.modules == {"rope": 3}  # layers 0-2 rotate; layer 3 keeps transformers' forward
        patched = ["forward" in layer.self_attn.__dict__ for layer in model.model.layers]
        assert patched == [True, True, True, False]
        loss = model(**batch).loss
        loss.backward()
    finally:
        patch.undo()
    # fp32: the kernel reorders sums only (as in test_kernel_apply)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides,problem",
    [
        ({}, None),
        ({"num_hidden_layers": 36}, None),  # SmolLM3-3B: NoPE layers 3, 7, ..., 35
        ({"no_rope_layer_interval": 3}, "NoPE layers [2] differ from every 4th layer"),
        ({"no_rope_layers": [1, 1, 1, 1]}, "NoPE layers [] differ from every 4th layer"),
        ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window layers (use_sliding_window)"),
    ],
)
def test_configs_llama_cpp_cannot_run_are_refused(overrides, problem):
    found = check_architecture(_config(**overrides))
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found and "\n" not in found, found


def _spec(tmp_path, model_dir) -> str:
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}) + "\n"
    )
    spec = tmp_path / "spec.yaml"
    fields = {"name": "s", "output_dir": str(tmp_path / "runs"), "model": {"name_or_path": str(model_dir)}}
    spec.write_text(yaml.safe_dump({**fields, "data": {"path": str(data)}}))
    return str(spec)


def test_validate_accepts_smollm3_and_refuses_what_llama_cpp_cannot_run(tmp_path, capsys):
    model_dir = save_tiny(tmp_path / "smollm3", "smollm3")
    spec = _spec(tmp_path, model_dir)
    assert main(["validate", spec]) == 0
    assert main(["plan", spec, "--gpu-memory", "16GiB", "--host-memory", "16GiB"]) == 0
    assert "family smollm3" in (scaffold := _init(model_dir, tmp_path, capsys))
    assert yaml.safe_load(scaffold)["model"]["name_or_path"] == str(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": [1, 1, 1, 1]}))
    capsys.readouterr()
    assert main(["validate", spec]) == EXIT_INVALID_SPEC
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smollm3 config: NoPE layers [] differ" in err[0], err
    assert not (tmp_path / "runs").exists()


def _init(model_dir, tmp_path, capsys) -> str:
    capsys.readouterr()
    data = tmp_path / "d.jsonl"
    assert main(["init", "--model", str(model_dir), "--data", str(data), "--gpu-memory", "16GiB"]) == 0
    return capsys.readouterr().out
